"""``--no-repeat-ngram-size`` on CPU bans exactly the tokens that would repeat an n-gram of the
tokens generated so far (brute-force reference), although the buffer is padded to max length
(fairseq issue #5206), and a generator using it still compiles with ``torch.jit.script``."""

import torch
from fairseq.ngram_repeat_block import NGramRepeatBlock

import torchscale_fairseq  # noqa: F401  (applies the fix)

PAD = 1


def banned_reference(prefix: list[int], n: int) -> set[int]:
    """Tokens ``t`` such that ``prefix[-(n-1):] + [t]`` already occurs in ``prefix``."""
    grams = {tuple(prefix[i : i + n]) for i in range(len(prefix) - n + 1)}
    return {g[-1] for g in grams if list(g[:-1]) == prefix[len(prefix) - (n - 1) :]}


def test_fallback_bans_repeated_ngrams_in_a_padded_buffer() -> None:
    torch.manual_seed(0)
    bsz, beam, vocab, max_len = 2, 3, 6, 20
    for n in (2, 3):
        for step in range(1, 12):
            generated = torch.randint(4, vocab, (bsz * beam, step + 1))
            tokens = torch.full((bsz * beam, max_len), PAD)
            tokens[:, : step + 1] = generated
            lprobs = torch.zeros(bsz * beam, vocab)
            out = NGramRepeatBlock(n, use_extension=False)(tokens, lprobs, bsz, beam, step)
            for row in range(bsz * beam):
                got = set(torch.nonzero(torch.isinf(out[row])).flatten().tolist())
                assert got == banned_reference(generated[row].tolist(), n), (n, step, row)


def tiny_transformer_and_dictionary():
    """A stock fairseq ``transformer`` (1-1 layers, d 16; TorchScript-able) with random weights."""
    import argparse

    from fairseq.data.dictionary import Dictionary
    from fairseq.models.transformer import TransformerModel
    from fairseq.tasks.fairseq_task import LegacyFairseqTask

    dictionary = Dictionary()
    for i in range(12):
        dictionary.add_symbol(f"w{i}")

    class Task(LegacyFairseqTask):
        source_dictionary = target_dictionary = dictionary

    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    TransformerModel.add_args(parser)
    args = parser.parse_args([])
    for side in ("encoder", "decoder"):
        for key, value in (("layers", 1), ("embed_dim", 16), ("ffn_embed_dim", 32), ("attention_heads", 2)):
            setattr(args, f"{side}_{key}", value)
    torch.manual_seed(0)
    return TransformerModel.build_model(args, Task(args)).eval(), dictionary


def repeated_bigrams(tokens: list[int]) -> int:
    bigrams = list(zip(tokens, tokens[1:]))
    return len(bigrams) - len(set(bigrams))


def test_scripted_generator_blocks_ngrams_like_eager() -> None:
    """``torch.jit.script`` of a SequenceGenerator with ``no_repeat_ngram_size`` works with the
    plugin imported (as on stock fairseq), and the scripted search equals the eager one."""
    from fairseq.sequence_generator import SequenceGenerator

    model, dictionary = tiny_transformer_and_dictionary()
    src_tokens = torch.randint(4, len(dictionary), (3, 6))
    src_tokens[:, -1] = dictionary.eos()
    sample = {"net_input": {"src_tokens": src_tokens, "src_lengths": torch.full((3,), 6)}}

    def generate(generator):
        with torch.no_grad():
            hypos = [h for sentence in generator(sample) for h in sentence]
        return [h["tokens"].tolist() for h in hypos], torch.stack([h["score"] for h in hypos])

    lengths = dict(beam_size=2, max_len_a=0, max_len_b=14, min_len=14)
    unblocked, _ = generate(SequenceGenerator([model], dictionary, **lengths))
    assert any(repeated_bigrams(tokens) for tokens in unblocked)  # the model repeats bigrams unless blocked

    eager = SequenceGenerator([model], dictionary, no_repeat_ngram_size=2, **lengths)
    scripted = torch.jit.script(eager)
    blocked, scores = generate(eager)
    assert all(repeated_bigrams(tokens) == 0 for tokens in blocked)
    scripted_blocked, scripted_scores = generate(scripted)
    assert scripted_blocked == blocked
    torch.testing.assert_close(scripted_scores, scores, rtol=0, atol=1e-5)
