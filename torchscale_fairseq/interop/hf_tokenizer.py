"""Hugging Face tokenizers whose ids are the fairseq dictionary's, for the dictionaries ``data_prep`` makes.

GPT-2 BPE (``data_prep.prepare_lm``'s default): that dictionary lists the GPT-2 ids 0..50256
after fairseq's four specials, so a fairseq id is the GPT-2 id + 4. The exported
``tokenizer.json`` is GPT-2's byte-level BPE with every token's id shifted by 4 (its
vocabulary and merges rebuilt offline from the tiktoken ranks of
:mod:`torchscale_fairseq.data.gpt2_bpe`) and the specials ``<s> <pad> </s> <unk>`` at 0..3.
Merges: the token of rank ``r >= 256`` is the merge of the two parts that BPE
with the ranks below ``r`` leaves of its bytes (GPT-2's ``merges.txt`` in rank order).

SentencePiece (``prepare_lm --spm-vocab``, ``prepare_nmt``, ``train_spm`` for ``streaming_mlm``):
the model's unigram or BPE pieces, each at its fairseq id (the dictionary is looked up by piece,
so its order need not be SentencePiece's), with SentencePiece's normalization (the model's
precompiled NFKC map, extra spaces removed, a ``▁`` prefix), read from the ``.model`` file
itself (a protobuf, parsed here: no ``protobuf`` dependency). Every dictionary symbol that is
not a piece (fairseq's specials, ``<mask>``, padding symbols) is a special token; as in every
transformers tokenizer, a special token's text in the input (``</s>``) gets its id, where fairseq
would encode its characters.

A ``ts_lm``'s texts start with ``</s>``, as fairseq feeds a language model; a ``ts_mlm``'s are
``<s> text </s>``, as ``streaming_mlm`` blocks start and its lines end.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fairseq.data import Dictionary

from torchscale_fairseq.data import gpt2_bpe
from torchscale_fairseq.data.document_encoders import MASK_SYMBOL, load_sentencepiece
from torchscale_fairseq.errors import TsConfigError

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
# sentencepiece_model.proto: ModelType UNIGRAM, BPE; piece types NORMAL, USER_DEFINED, BYTE
UNIGRAM, BPE = 1, 2
NORMAL, USER_DEFINED, BYTE = 1, 4, 6
MADE_UP_WORD = re.compile(r"madeupword\d+")  # fairseq's padding of a dictionary to a multiple (--padding-factor)


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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = gpt2_vocab_and_merges(len(SPECIALS))
    for i, symbol in enumerate(dictionary.symbols):
        if i < len(SPECIALS) or i >= len(SPECIALS) + gpt2_bpe.N_VOCAB:
            vocab[symbol] = i
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return _save(backend, dictionary, SPECIALS, "lm", out, max_length)


def _save(backend: Any, dictionary: Dictionary, specials: list[str] | tuple[str, ...], kind: str, out: Path,
          max_length: int, unused_pieces: bool = False) -> list[str]:
    """Add the ``kind``'s framing (``</s> text`` for an LM, ``<s> text </s>`` for a masked LM, ``text </s>``
    for a translation model's source) and the
    special tokens to the ``tokenizers`` object ``backend``; save it as a transformers tokenizer into ``out``.
    With ``unused_pieces`` (backend ids from ``len(dictionary)`` on are pieces fairseq maps to ``<unk>``),
    the tokenizer is :class:`TsTokenizerFast`, saved with its code (``tokenization_ts.py``)."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    bos, eos = dictionary.bos_word, dictionary.eos_word
    if kind == "lm":
        single, pair, bos = f"{eos} $A", f"{eos} $A $B", eos
    elif kind == "mt":
        single, pair = f"$A {eos}", f"$A {eos} $B {eos}"
    else:
        single, pair = f"{bos} $A {eos}", f"{bos} $A {eos} $B {eos}"
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(s, dictionary.index(s)) for s in dict.fromkeys((bos, eos))])
    backend.add_special_tokens([AddedToken(s, special=True) for s in specials])
    extra = {"mask_token": MASK_SYMBOL} if kind == "mlm" and MASK_SYMBOL in dictionary.indices else {}
    if unused_pieces:
        from torchscale_fairseq.interop.hf_modeling.tokenization_ts import TsTokenizerFast

        extra["dictionary_size"] = len(dictionary)
        tokenizer_class = TsTokenizerFast
        tokenizer_class.register_for_auto_class("AutoTokenizer")
    else:
        tokenizer_class = PreTrainedTokenizerFast
    tokenizer = tokenizer_class(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=dictionary.pad_word,
        unk_token=dictionary.unk_word, model_max_length=max_length, **extra,
    )
    written = [Path(p).name for p in tokenizer.save_pretrained(str(out))]
    return written + (["tokenization_ts.py"] if unused_pieces and "tokenization_ts.py" not in written else [])


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The protobuf varint at ``data[pos:]`` and the position after it."""
    value = shift = 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _fields(data: bytes) -> Iterator[tuple[int, Any]]:
    """``(field number, value)`` of a protobuf message: varints as ints, length-delimited fields as
    bytes, 32-bit fields as floats (the only fixed-size fields of a SentencePiece model)."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        wire = key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = struct.unpack("<f", data[pos:pos + 4])[0], pos + 4
        else:
            raise ValueError(f"protobuf wire type {wire}")
        yield key >> 3, value


@dataclass
class SpmModel:
    """What a SentencePiece ``.model`` holds that the tokenizer needs (``sentencepiece_model.proto``)."""

    pieces: list[tuple[str, float, int]]  # piece, score, type
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def read_spm_model(path: Path) -> SpmModel:
    """The pieces, model type and normalizer of the SentencePiece model at ``path`` (one-line error if invalid)."""
    load_sentencepiece(path)
    model = SpmModel(pieces=[])
    for field, value in _fields(path.read_bytes()):
        if field == 1:
            piece = dict(_fields(value))
            model.pieces.append((piece.get(1, b"").decode("utf-8"), piece.get(2, 0.0), piece.get(3, NORMAL)))
        elif field == 2:
            trainer = dict(_fields(value))
            model.model_type, model.byte_fallback = trainer.get(3, UNIGRAM), bool(trainer.get(35, 0))
        elif field == 3:
            spec = dict(_fields(value))
            model.charsmap = spec.get(2, b"")
            model.add_dummy_prefix, model.remove_extra_whitespaces, model.escape_whitespaces = (
                bool(spec.get(n, 1)) for n in (3, 4, 5))
    return model


def _spm_backend(spm: SpmModel, dictionary: Dictionary, normal: dict[str, tuple[float, int]],
                 unused: list[str]) -> Any:
    """The ``tokenizers`` model, normalizer, pre-tokenizer and decoder of ``spm`` (as transformers'
    ``SpmConverter`` builds them, in SentencePiece's order), ids from ``dictionary``; the ``unused``
    pieces (not in the dictionary) follow at ``len(dictionary)`` on, so the segmentation is the model's."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    symbols = [*dictionary.symbols, *unused]
    if spm.model_type == UNIGRAM:
        vocab = [(s, normal[s][0] if s in normal else 0.0) for s in symbols]
        backend = Tokenizer(models.Unigram(vocab, unk_id=dictionary.unk()))
    else:  # BPE merges: every split of a piece into two pieces, ranked by the piece's score, then id
        ranked = sorted((-score, i, piece[:k], piece[k:]) for piece, (score, i) in normal.items()
                        for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal)
        backend = Tokenizer(models.BPE({s: i for i, s in enumerate(symbols)},
                                       [(a, b) for _, _, a, b in ranked], unk_token=dictionary.unk_word,
                                       fuse_unk=True))
    steps = [normalizers.Precompiled(spm.charsmap)] if spm.charsmap else []
    if spm.remove_extra_whitespaces:  # spaces only: SentencePiece leaves other whitespace alone
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if spm.add_dummy_prefix:  # Metaspace adds no prefix to a text starting with "▁"; SentencePiece does
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    backend.normalizer = normalizers.Sequence(steps)
    fuse = [decoders.Fuse(), decoders.Strip(content=" ", left=1)] if spm.add_dummy_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), *fuse])
    return backend


def save_spm_tokenizer(dictionary: Dictionary, model_path: Path, kind: str, out: Path, max_length: int) -> list[str]:
    """Write the tokenizer of SentencePiece model ``model_path`` with the fairseq ids of ``dictionary``
    into ``out``; a one-line :class:`TsConfigError` if the model is not the dictionary's or not supported."""
    spm = read_spm_model(model_path)
    if spm.model_type not in (UNIGRAM, BPE):
        raise TsConfigError(f"SentencePiece model {model_path} is a word or char model: only unigram and bpe "
                            "models (data_prep's) can be exported as a tokenizer")
    if spm.byte_fallback or any(type_ in (USER_DEFINED, BYTE) for _, _, type_ in spm.pieces):
        raise TsConfigError(f"SentencePiece model {model_path} has byte-fallback or user-defined pieces, which "
                            "data_prep never trains: no tokenizer can be exported for it")
    normal = {piece: (score, i) for i, (piece, score, type_) in enumerate(spm.pieces) if type_ == NORMAL}
    foreign = [s for s in dictionary.symbols[dictionary.nspecial:]
               if s not in normal and s != MASK_SYMBOL and not MADE_UP_WORD.fullmatch(s)]
    if foreign:
        raise TsConfigError(f"{len(foreign)} symbols of the model's dictionary (e.g. {foreign[0]!r}) are not pieces "
                            f"of SentencePiece model {model_path}: pass the SentencePiece model the dictionary was "
                            "built from (--spm-model)")
    unused = [piece for piece in normal if piece not in dictionary.indices]  # fairseq: <unk>
    specials = [s for s in dictionary.symbols if s not in normal]
    return _save(_spm_backend(spm, dictionary, normal, unused), dictionary, specials, kind, out, max_length,
                 unused_pieces=bool(unused))
