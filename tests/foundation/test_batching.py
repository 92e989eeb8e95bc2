"""Batching keeps every sample (fairseq 0.12.2 semantics; fairseq-fixed drops the tail)."""

import numpy as np
import pytest
from fairseq.data import data_utils

import torchscale_fairseq  # noqa: F401  (installs the fixed batch_by_size)


@pytest.mark.parametrize("n,max_sentences,mult", [(5, 16, 8), (5, 1, 8), (80, 1, 8), (21, 3, 8), (7, 2, 2)])
def test_every_sample_is_batched_once_in_order(n, max_sentences, mult):
    batches = data_utils.batch_by_size(np.arange(n, dtype=np.int64), lambda i: 10, max_sentences=max_sentences,
                                       required_batch_size_multiple=mult)
    assert np.concatenate(batches).tolist() == list(range(n))
    assert all(len(b) <= max_sentences for b in batches)


def test_token_budget_counts_padding():
    sizes = np.random.RandomState(0).randint(1, 20, size=300)
    batches = data_utils.batch_by_size(np.arange(300, dtype=np.int64), lambda i: int(sizes[i]), max_tokens=64,
                                       required_batch_size_multiple=4)
    assert np.concatenate(batches).tolist() == list(range(300))
    assert all(len(b) * sizes[b].max() <= 64 for b in batches)
    assert all(len(b) % 4 == 0 for b in batches[:-1] if len(b) >= 4)
