"""Ring attention (``model_parallel/context_parallel.py``) on gloo processes, C = 2, 3, 4: every
rank's output and query/key/value gradients equal those of plain causal attention on the whole
sequence; each rank sends the bytes of the module docstring's formula; the load-balanced chunks
cover the sequence once."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cli_utils import WORKERS
from tests.helpers.mp_helpers import run_worker_ranks
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.context_parallel import context_parallel_indices, pad_to_multiple

WORKER = WORKERS / "ring_attention_worker.py"
TOL = {"float64": 1e-12, "float32": 2e-5}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_worker_ranks(WORKER, 4, tmp_path_factory.mktemp("ring"))


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_ring_attention_equals_full_causal_attention(results, size, dtype):
    ranks = results[str(size)]
    assert len(ranks) == size
    for rank in ranks:
        for name, error in rank[dtype]["errors"].items():
            assert error < TOL[dtype], (size, name, error)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_ring_sends_the_formula(results, size):
    for rank in results[str(size)]:
        b, h, length, d = rank["float64"]["shape"]
        block = b * h * (length // size) * d  # one rank's keys (or values)
        assert rank["float64"]["sent"]["forward"] == (size - 1) * 2 * block
        assert rank["float64"]["sent"]["backward"] == (size - 1) * 2 * block + size * 2 * block


@pytest.mark.parametrize("size", [1, 2, 3])
def test_chunks_cover_the_sequence_once_balanced(size):
    length = 12 * size
    held = [context_parallel_indices(length, size, r) for r in range(size)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(length))
    causal_work = [int((idx + 1).sum()) for idx in held]  # keys each rank's queries see
    assert len(set(causal_work)) == 1


def test_length_not_split_into_2c_chunks_is_one_line():
    with pytest.raises(TsConfigError, match="does not split into 4 equal chunks"):
        context_parallel_indices(10, 2, 0)


def test_pad_to_multiple():
    tokens = torch.arange(10).view(2, 5)
    padded = pad_to_multiple(tokens, 4, -1)
    assert padded.shape == (2, 8) and torch.equal(padded[:, :5], tokens) and bool((padded[:, 5:] == -1).all())
