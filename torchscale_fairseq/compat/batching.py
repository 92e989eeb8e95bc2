"""fairseq issue #5036: ``data_utils.batch_by_size`` drops the last batch when its size is not a
multiple of ``--required-batch-size-multiple`` (default 8): 5 validation samples at
``--batch-size 16`` give *no* batch, and ``fairseq-generate --batch-size 1`` translates 79 of 80
sentences.

Applies to ``fairseq-fixed`` 0.12.3.1 and fairseq ``main`` since commit d871f616 ("data2vec
v2.0", Dec 2022), which added ``if bsz_mult > 1 and len(b[-1]) % bsz_mult != 0: b = b[:-1]``
after the compiled ``data_utils_fast.batch_by_size_vec`` / ``batch_by_size_fn``. fairseq 0.12.2
(and the v0.12.3 tag) return the compiled batches as they are, as this fix does.
The same line also raises ``IndexError`` on an empty index list (0.12.2 returns ``[]``).

The compiled functions themselves are right (they equal fairseq's reference algorithm,
``batch_by_size_baseline`` in fairseq's ``tests/test_data_utils.py``, and keep the last batch);
we call them as fairseq 0.12.2 does.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np
from fairseq.data import data_utils
from fairseq.data.data_utils_fast import batch_by_size_fn, batch_by_size_vec

_stock_batch_by_size = data_utils.batch_by_size


def batch_by_size(
    indices,
    num_tokens_fn: Callable[[int], int],
    num_tokens_vec: Optional[np.ndarray] = None,
    max_tokens: Optional[int] = None,
    max_sentences: Optional[int] = None,
    required_batch_size_multiple: int = 1,
    fixed_shapes: Optional[Sequence] = None,
) -> List[np.ndarray]:
    """fairseq 0.12.2's ``batch_by_size``: every batch of the compiled ``data_utils_fast``."""
    if fixed_shapes is not None:
        return _stock_batch_by_size(indices, num_tokens_fn, num_tokens_vec, max_tokens, max_sentences,
                                    required_batch_size_multiple, fixed_shapes)
    if not isinstance(indices, np.ndarray):
        indices = np.fromiter(indices, dtype=np.int64, count=-1)
    max_tokens = int(max_tokens) if max_tokens is not None else -1
    max_sentences = max_sentences if max_sentences is not None else -1
    if num_tokens_vec is None:
        return batch_by_size_fn(indices, num_tokens_fn, max_tokens, max_sentences, required_batch_size_multiple)
    if not isinstance(num_tokens_vec, np.ndarray):
        num_tokens_vec = np.fromiter(num_tokens_vec, dtype=np.int64, count=-1)
    return batch_by_size_vec(indices, num_tokens_vec, max_tokens, max_sentences, required_batch_size_multiple)


def patch_batching() -> None:
    data_utils.batch_by_size = batch_by_size
