"""Raw-text documents -> fairseq ids, for the streaming tasks.

A document's ids are ``ids(line) + </s>`` for each line, then one more ``</s>`` (end of
document): exactly what ``fairseq-preprocess`` gives for the same lines followed by a blank
line. Two tokenizers:

- :class:`GPT2Documents`: GPT-2 BPE (``data_prep`` LM ids, fairseq id = GPT-2 id + 4);
- :class:`SentencePieceDocuments`: a SentencePiece model, fairseq ids from
  :func:`sentencepiece_dictionary` (the same ids ``--bpe sentencepiece`` followed by
  ``fairseq-preprocess --srcdict`` of that dictionary gives).

Both are picklable (loader workers rebuild the tokenizer on first use).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm
from fairseq.data import Dictionary

from torchscale_fairseq.data import gpt2_bpe
from torchscale_fairseq.errors import TsConfigError

MASK_SYMBOL = "<mask>"


def join_lines(line_ids: Iterable[list[int]], eos: int) -> list[int]:
    """``line + [eos]`` for each line, then ``eos`` (end of document)."""
    ids: list[int] = []
    for line in line_ids:
        ids.extend(line)
        ids.append(eos)
    ids.append(eos)
    return ids


class GPT2Documents:
    """Documents as ``data_prep`` GPT-2 ids shifted by ``offset`` (fairseq's specials)."""

    def __init__(self, eos: int, offset: int) -> None:
        self.eos, self.offset = eos, offset

    def __call__(self, lines: Sequence[str]) -> list[int]:
        encoding = gpt2_bpe.get_gpt2_encoding()
        return join_lines(([i + self.offset for i in encoding.encode_ordinary(line)] for line in lines), self.eos)


def load_sentencepiece(path: str | Path) -> spm.SentencePieceProcessor:
    """The SentencePiece model at ``path``; a one-line :class:`TsConfigError` if missing or invalid."""
    path = Path(path)
    if not path.is_file():
        raise TsConfigError(
            f"SentencePiece model {path} does not exist; pass --spm-model, "
            "or train one with: python -m data_prep.train_spm DATA"
        )
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as err:
        detail = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise TsConfigError(f"SentencePiece model {path} cannot be loaded ({detail}); retrain it") from err


def sentencepiece_dictionary(processor: spm.SentencePieceProcessor) -> Dictionary:
    """fairseq's 4 specials, the model's pieces in id order (control and unknown pieces
    excluded: fairseq has its own), then ``<mask>``."""
    dictionary = Dictionary()
    for i in range(processor.get_piece_size()):
        if not (processor.is_control(i) or processor.is_unknown(i)):
            dictionary.add_symbol(processor.id_to_piece(i), n=1)
    dictionary.add_symbol(MASK_SYMBOL, n=1)
    return dictionary


class SentencePieceDocuments:
    """Documents as ids of a fairseq dictionary over SentencePiece pieces."""

    def __init__(self, model_path: str, dictionary: Dictionary) -> None:
        self.model_path = model_path
        self.eos = dictionary.eos()
        processor = load_sentencepiece(model_path)
        self.table = [dictionary.index(processor.id_to_piece(i)) for i in range(processor.get_piece_size())]
        self._processor: spm.SentencePieceProcessor | None = processor

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_processor": None}

    def __call__(self, lines: Sequence[str]) -> list[int]:
        if self._processor is None:
            self._processor = load_sentencepiece(self.model_path)
        table = self.table
        return join_lines(([table[i] for i in ids] for ids in self._processor.encode(list(lines))), self.eos)
