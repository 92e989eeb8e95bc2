"""``data_utils.batch_by_size`` with the plugin imported equals fairseq's reference algorithm
(``batch_by_size_baseline`` of fairseq's ``tests/test_data_utils.py``, ported below) on random and
edge cases, keeping the last batch that fairseq-fixed drops (fairseq issue #5036)."""

from typing import List

import numpy as np
import pytest
from fairseq.data import data_utils

import torchscale_fairseq  # noqa: F401  (installs the fixed batch_by_size)


def batch_by_size_baseline(num_tokens: List[int], max_tokens: int, max_sentences: int, bsz_mult: int) -> List[List[int]]:
    """fairseq's slow reference: grow a batch from ``start`` until it overflows (padded size
    ``count x longest`` above ``max_tokens`` or count above ``max_sentences``; <= 0 means no
    limit) or the data ends, then cut it to a multiple of ``bsz_mult`` when it is larger than
    ``bsz_mult``. Returns positions."""
    batches, start = [], 0
    while start < len(num_tokens):
        for end in range(start + 1, len(num_tokens) + 1):
            count = end - start
            overflow = max(num_tokens[start:end]) * count > max_tokens > 0 or count > max_sentences > 0
            if overflow or end == len(num_tokens):
                count -= int(overflow)
                if count > bsz_mult:
                    count -= count % bsz_mult
                batches.append(list(range(start, start + count)))
                start += count
                break
    return batches


def plugin_batches(num_tokens: List[int], max_tokens: int, max_sentences: int, bsz_mult: int, offset: int = 100):
    """``data_utils.batch_by_size`` over indices ``offset + position`` (so indices differ from
    positions), as positions; 0 limits are passed as fairseq's ``None``."""
    indices = np.arange(offset, offset + len(num_tokens), dtype=np.int64)
    batches = data_utils.batch_by_size(indices, None, num_tokens_vec=np.asarray(num_tokens, dtype=np.int64),
                                       max_tokens=max_tokens or None, max_sentences=max_sentences or None,
                                       required_batch_size_multiple=bsz_mult)
    return [(np.asarray(b) - offset).tolist() for b in batches]


def test_named_counterexamples() -> None:
    # A pure-Python loop once gave a batch of 2 x 8 = 16 tokens here at max_tokens=9.
    lengths = [8, 3, 3, 1, 8, 2, 5, 9, 1, 4]
    got = plugin_batches(lengths, max_tokens=9, max_sentences=0, bsz_mult=2)
    assert got == batch_by_size_baseline(lengths, 9, 0, 2)
    assert all(len(b) * max(lengths[i] for i in b) <= 9 for b in got)
    # The last batch obeys bsz_mult too: three samples at multiple 2 are [2], [1], not [3].
    assert plugin_batches([7, 8, 9], max_tokens=0, max_sentences=0, bsz_mult=2) == [[0, 1], [2]]


@pytest.mark.parametrize("seed", range(4))
def test_equals_fairseq_reference_on_random_cases(seed: int) -> None:
    rng = np.random.RandomState(seed)
    for _ in range(1500):
        n = int(rng.randint(1, 40))
        max_tokens = int(rng.choice([0, rng.randint(1, 64)]))
        max_sentences = int(rng.choice([0, rng.randint(1, 20)]))
        bsz_mult = int(rng.choice([1, 2, 3, 8, rng.randint(1, 50)]))
        lengths = rng.randint(1, (max_tokens or 64) + 1, size=n).tolist()
        want = batch_by_size_baseline(lengths, max_tokens, max_sentences, bsz_mult)
        assert plugin_batches(lengths, max_tokens, max_sentences, bsz_mult) == want, (lengths, max_tokens,
                                                                                     max_sentences, bsz_mult)


@pytest.mark.parametrize("n,max_sentences,mult", [(5, 16, 8), (5, 1, 8), (80, 1, 8), (21, 3, 8), (7, 2, 2), (16, 16, 8)])
def test_every_sample_is_batched_once_in_order(n: int, max_sentences: int, mult: int) -> None:
    batches = data_utils.batch_by_size(np.arange(n, dtype=np.int64), lambda i: 10, max_sentences=max_sentences,
                                       required_batch_size_multiple=mult)
    assert np.concatenate(batches).tolist() == list(range(n))
    assert all(len(b) <= max_sentences for b in batches)
    assert [len(b) for b in batches] == [len(b) for b in batch_by_size_baseline([10] * n, 0, max_sentences, mult)]


def test_token_budget_counts_padding() -> None:
    sizes = np.random.RandomState(0).randint(1, 20, size=300)
    batches = data_utils.batch_by_size(np.arange(300, dtype=np.int64), lambda i: int(sizes[i]), max_tokens=64,
                                       required_batch_size_multiple=4)
    assert np.concatenate(batches).tolist() == list(range(300))
    assert all(len(b) * sizes[b].max() <= 64 for b in batches)
    assert all(len(b) % 4 == 0 for b in batches[:-1] if len(b) >= 4)
    assert [b.tolist() for b in batches] == batch_by_size_baseline(sizes.tolist(), 64, 0, 4)


def test_edge_cases() -> None:
    assert data_utils.batch_by_size(np.zeros(0, dtype=np.int64), lambda i: 1, max_sentences=4,
                                    required_batch_size_multiple=8) == []
    # A single sample, and a list (not an array) of indices through num_tokens_fn.
    assert [b.tolist() for b in data_utils.batch_by_size([3], lambda i: 5, max_tokens=5,
                                                           required_batch_size_multiple=8)] == [[3]]
    batches = data_utils.batch_by_size(iter(range(11)), lambda i: 2, max_sentences=4, required_batch_size_multiple=3)
    assert [b.tolist() for b in batches] == batch_by_size_baseline([2] * 11, 0, 4, 3)
    # No limits at all: one batch cut to the multiple, then the rest.
    assert plugin_batches([1] * 19, 0, 0, 8) == batch_by_size_baseline([1] * 19, 0, 0, 8) == [list(range(16)),
                                                                                             [16, 17, 18]]
