"""``fairseq-fixed`` 0.12.3.1's compiled ``batch_by_size`` drops the trailing samples that
do not fill a multiple of ``--required-batch-size-multiple`` (default 8): 5 validation
samples at ``--batch-size 16`` give *no* batch, and ``fairseq-generate --batch-size 1``
translates 79 of 80 sentences. fairseq 0.12.2 keeps them in a last, smaller batch. We
restore that behaviour with the reference algorithm: fill a batch until the next sample
would exceed ``max_tokens`` (padded: count x longest) or ``max_sentences``, emit the
largest multiple of ``bsz_mult`` (or the remainder when smaller), carry the rest over,
and emit whatever is left at the end."""

from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np
from fairseq.data import data_utils

_stock_batch_by_size = data_utils.batch_by_size


def batch_by_size_reference(
    indices: np.ndarray, num_tokens: np.ndarray, max_tokens: int, max_sentences: int, bsz_mult: int
) -> List[np.ndarray]:
    batches: List[np.ndarray] = []
    batch: List[int] = []
    lens: List[int] = []
    longest = 0
    for idx, n in zip(indices.tolist(), num_tokens.tolist()):
        longest = max(longest, n)
        if max_tokens > 0 and n > max_tokens:
            raise ValueError(f"sentence at index {idx} of size {n} exceeds max_tokens limit of {max_tokens}!")
        full = batch and (
            (max_sentences > 0 and len(batch) == max_sentences)
            or (max_tokens > 0 and (len(batch) + 1) * longest > max_tokens)
        )
        if full:
            keep = max(bsz_mult * (len(batch) // bsz_mult), len(batch) % bsz_mult)
            batches.append(np.array(batch[:keep], dtype=np.int64))
            batch, lens = batch[keep:], lens[keep:]
            longest = max(lens + [n])
        batch.append(idx)
        lens.append(n)
    if batch:
        batches.append(np.array(batch, dtype=np.int64))
    return batches


def batch_by_size(
    indices, num_tokens_fn: Callable, num_tokens_vec: Optional[np.ndarray] = None, max_tokens=None,
    max_sentences=None, required_batch_size_multiple: int = 1, fixed_shapes=None,
):
    if fixed_shapes is not None:
        return _stock_batch_by_size(indices, num_tokens_fn, num_tokens_vec, max_tokens, max_sentences,
                                    required_batch_size_multiple, fixed_shapes)
    indices = np.asarray(indices, dtype=np.int64)
    if num_tokens_vec is None:
        num_tokens_vec = np.fromiter((num_tokens_fn(i) for i in indices), dtype=np.int64, count=len(indices))
    return batch_by_size_reference(indices, np.asarray(num_tokens_vec, dtype=np.int64), int(max_tokens or -1),
                                   int(max_sentences or -1), int(required_batch_size_multiple))


def patch_batching() -> None:
    data_utils.batch_by_size = batch_by_size
