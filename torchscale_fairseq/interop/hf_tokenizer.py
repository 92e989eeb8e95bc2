"""A Hugging Face tokenizer for models trained on ``data_prep.prepare_lm``'s GPT-2 BPE dictionary.

That dictionary lists the GPT-2 ids 0..50256 after fairseq's four specials, so a fairseq
id is the GPT-2 id + 4. The exported ``tokenizer.json`` is GPT-2's byte-level BPE with
every token's id shifted by 4 (its vocabulary and merges rebuilt offline from the tiktoken
ranks of :mod:`torchscale_fairseq.data.gpt2_bpe`), the specials ``<s> <pad> </s> <unk>``
at 0..3, and a post-processor that puts ``</s>`` first, as fairseq feeds a language
model. Merges: the token of rank ``r >= 256`` is the merge of the two parts that BPE
with the ranks below ``r`` leaves of its bytes (GPT-2's ``merges.txt`` in rank order).
"""

from __future__ import annotations

from pathlib import Path

from fairseq.data import Dictionary

from torchscale_fairseq.data import gpt2_bpe

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


def is_gpt2_dictionary(dictionary: Dictionary) -> bool:
    """Whether ``dictionary`` is fairseq's four specials then the GPT-2 ids 0..50256 in order."""
    offset = len(SPECIALS)
    return (
        tuple(dictionary.symbols[:offset]) == SPECIALS
        and len(dictionary) >= offset + gpt2_bpe.N_VOCAB
        and all(dictionary.symbols[offset + i] == str(i) for i in range(gpt2_bpe.N_VOCAB))
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character of every byte (byte-level BPE's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """``token``'s parts after byte-pair merging with the merges of rank below ``max_rank``."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best = min(((ranks.get(a + b, max_rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))))
        if best[0] >= max_rank:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def gpt2_vocab_and_merges(offset: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocabulary (GPT-2 id + ``offset``) and merges, in rank order."""
    ranks = gpt2_bpe.get_gpt2_encoding()._mergeable_ranks
    char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(char[x] for x in b)

    vocab = {text(token): rank + offset for token, rank in ranks.items()}
    vocab[gpt2_bpe.ENDOFTEXT] = gpt2_bpe.ENDOFTEXT_ID + offset
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _split(ranks, token, rank)
            merges.append((text(left), text(right)))
    return vocab, merges


def save_gpt2_tokenizer(dictionary: Dictionary, out: Path, max_length: int) -> list[str]:
    """Write the tokenizer files for the fairseq GPT-2 dictionary ``dictionary`` into ``out``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = gpt2_vocab_and_merges(len(SPECIALS))
    for i, symbol in enumerate(dictionary.symbols):
        if i < len(SPECIALS) or i >= len(SPECIALS) + gpt2_bpe.N_VOCAB:
            vocab[symbol] = i
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    eos = dictionary.eos_word
    backend.post_processor = processors.TemplateProcessing(
        single=f"{eos} $A", pair=f"{eos} $A $B", special_tokens=[(eos, dictionary.eos())])
    backend.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=eos, eos_token=eos, pad_token=dictionary.pad_word,
        unk_token=dictionary.unk_word, model_max_length=max_length,
    )
    return [Path(p).name for p in tokenizer.save_pretrained(str(out))]
