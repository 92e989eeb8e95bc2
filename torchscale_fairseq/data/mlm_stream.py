"""The ``streaming_mlm`` samples: packed blocks ``<s> + (tokens_per_sample - 1)`` stream tokens, span-masked.

Training reuses :class:`~torchscale_fairseq.data.lm_stream.LMBlockStream` (same readers,
mixing, sharding and resumable position); only the block layout and the sample differ.
The mask of a block is drawn from a seed fixed by (seed, reader, block number), so a
resumed run masks its blocks exactly as an uninterrupted one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch
from fairseq.data import FairseqDataset, data_utils

from torchscale_fairseq.data.lm_stream import LMBlockStream, document_ids
from torchscale_fairseq.data.span_masking import mask_spans


class SpanMasker:
    """``(source, target)`` of one block ``<s> + tokens``; the ``<s>`` is never masked."""

    def __init__(self, bos: int, pad: int, mask_idx: int, mask_prob: float, span_length: float, seed: int) -> None:
        self.bos, self.pad, self.mask_idx = bos, pad, mask_idx
        self.mask_prob, self.span_length, self.seed = mask_prob, span_length, seed

    def __call__(self, tokens: Sequence[int], key: str) -> tuple[list[int], list[int]]:
        rng = random.Random(f"mask:{self.seed}:{key}")
        return mask_spans([self.bos, *tokens], 1, self.mask_idx, self.pad, self.mask_prob, self.span_length, rng)


def masked_batch(pairs: Sequence[tuple[list[int], list[int]]], ids: torch.Tensor, pad: int,
                 starts: Sequence[Sequence[int]] | None = None) -> dict:
    """A fairseq ``masked_lm`` sample from ``(source, target)`` pairs (right-padded); with
    ``starts`` (source positions where a document begins) ``net_input`` carries ``document_ids``
    (a pad belongs to its row's last document)."""
    source = data_utils.collate_tokens([torch.tensor(s) for s, _ in pairs], pad)
    target = data_utils.collate_tokens([torch.tensor(t) for _, t in pairs], pad)
    lengths = torch.tensor([len(s) for s, _ in pairs])
    net_input = {"src_tokens": source, "src_lengths": lengths}
    if starts is not None:
        net_input["document_ids"] = document_ids(starts, source.size(1))
    return {
        "id": ids,
        "nsentences": len(pairs),
        "ntokens": int(lengths.sum()),
        "net_input": net_input,
        "target": target,
    }


def block_starts(stream_starts: Sequence[int]) -> list[int]:
    """Source positions of ``<s> + tokens`` where a document begins, from the indices into
    ``tokens`` where one begins: index ``p`` is position ``p + 1``; the ``<s>`` and a document
    beginning right after it are one document (position 1 dropped)."""
    return [p + 1 for p in stream_starts if p >= 1]


class MaskedBlockStream(LMBlockStream):
    """Training batches of span-masked blocks (see the module docstring)."""

    def __init__(self, *args, masker: SpanMasker, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.masker = masker
        self.block_tokens = self.tokens_per_sample - 1

    def collate(self, rows: list[list[int]], starts: list[list[int]], first_block: int, reader: int,
                state: tuple[int, dict]) -> dict:
        """Drop the token before each block (no shift in a masked LM), prepend ``<s>``, mask."""
        pairs = [self.masker(row[1:], f"{reader}:{first_block + i}") for i, row in enumerate(rows)]
        ids = self.sample_ids(first_block, len(rows), reader)
        doc_starts = [block_starts([p - 1 for p in row]) for row in starts] if self.document_masking else None
        return {**masked_batch(pairs, ids, self.masker.pad, doc_starts), "stream_state": state}


class MaskedBlockDataset(FairseqDataset):
    """Held-out documents packed once into blocks of ``<s> + (tokens_per_sample - 1)`` tokens, masked
    (with ``document_masking``, batches carry ``document_ids``)."""

    def __init__(self, documents: Sequence[Sequence[int]], tokens_per_sample: int, masker: SpanMasker,
                 document_masking: bool = False) -> None:
        stream = [t for doc in documents for t in doc]
        step = tokens_per_sample - 1
        self.pairs = [masker(stream[i : i + step], f"valid:{i // step}") for i in range(0, len(stream), step)]
        self.starts = None
        if document_masking:
            begins = np.cumsum([0] + [len(doc) for doc in documents[:-1]])
            cuts = np.searchsorted(begins, np.arange(0, len(stream) + step, step))
            self.starts = [block_starts((begins[cuts[b] : cuts[b + 1]] - b * step).tolist()) for b in range(len(self.pairs))]
        self.pad = masker.pad
        self.sizes = np.array([len(s) for s, _ in self.pairs], dtype=np.int64)

    def __getitem__(self, index: int) -> dict:
        return {"id": index, "pair": self.pairs[index]}

    def __len__(self) -> int:
        return len(self.pairs)

    def collater(self, samples: list[dict]) -> dict:
        if not samples:
            return {}
        ids = [s["id"] for s in samples]
        starts = [self.starts[i] for i in ids] if self.starts is not None else None
        return masked_batch([s["pair"] for s in samples], torch.tensor(ids), self.pad, starts)

    def num_tokens(self, index: int) -> int:
        return int(self.sizes[index])

    def size(self, index: int) -> int:
        return int(self.sizes[index])

    def ordered_indices(self) -> np.ndarray:
        return np.arange(len(self))
