"""The RNG tracker: ``fork`` draws from the per-rank stream without touching the default
generator, and activation checkpointing replays the same dropout mask in backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torchscale_fairseq.model_parallel.random import checkpoint_context, get_rng_tracker, model_parallel_seed


@pytest.fixture
def two_way():
    """Rank 0 of tensor-parallel size 2 as the tracker sees it (no collective is involved)."""
    model_parallel_seed(7, 0, 2)
    yield
    get_rng_tracker().reset()


def _dropout_in_parallel_region(x: torch.Tensor) -> torch.Tensor:
    with get_rng_tracker().fork():
        return F.dropout(x, 0.5, training=True)


def test_fork_leaves_the_default_generator_alone(two_way):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    _dropout_in_parallel_region(torch.ones(100))
    assert torch.equal(torch.rand(3), expected)


def test_checkpoint_recomputation_replays_the_tracker_stream(two_way):
    x = torch.ones(1000, requires_grad=True)
    y = checkpoint(_dropout_in_parallel_region, x, use_reentrant=False, context_fn=checkpoint_context)
    y.sum().backward()
    assert torch.equal(x.grad, y.detach()), "backward used a different dropout mask than forward"
    assert 0 < int(y.eq(0).sum()) < 1000
