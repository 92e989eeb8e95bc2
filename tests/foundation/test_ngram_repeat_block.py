"""``--no-repeat-ngram-size`` on CPU bans exactly the tokens that would repeat an n-gram of the
tokens generated so far (brute-force reference), although the buffer is padded to max length."""

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
