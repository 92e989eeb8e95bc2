"""Tensor- and expert-parallel code on CUDA tensors.

One GPU cannot hold two NCCL ranks (NCCL refuses two ranks on one device), so the
2-rank checks run 2 processes sharing the GPU over gloo. PyTorch's backend table lists
only ``broadcast`` and ``all_reduce`` as gloo collectives on CUDA tensors; gloo's
``ProcessGroupGloo`` also stages ``all_gather`` and ``all_to_all`` of CUDA tensors through
host memory (``AsyncAllgatherCUDAWork``, ``AsyncAlltoallCUDAWork``), which the 2-rank
checks use. The same collectives run on NCCL at world size 1 (``nccl_worker.py``).
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.cli_utils import REPO, WORKERS, run, run_many
from tests.helpers.mp_helpers import run_worker_ranks
from tests.helpers.rendezvous import rendezvous_url
from tests.modules.moe.test_distributed import EXPERT_PARALLEL_EQUIVALENCE
from torchscale_fairseq.model_parallel import random as tp_random
from torchscale_fairseq.model_parallel.random import get_rng_tracker, model_parallel_seed

pytestmark = pytest.mark.gpu

LAYER_WORKER = WORKERS / "layer_worker.py"


def test_parallel_layers_on_cuda_equal_dense(tmp_path):
    """``layer_worker.py`` (the CPU layer checks of ``test_mp_layers.py``) with every tensor on the GPU."""
    errors = run_worker_ranks(LAYER_WORKER, 2, tmp_path, "cuda", timeout=300)["errors"]
    assert set(errors) == {"column", "row", "embedding", "layernorm", "cross_entropy", "linear_cross_entropy",
                           "magneto", "preln", "sp_magneto", "sp_preln", "sp_moe"}
    for layer, values in errors.items():
        for what, value in values.items():
            # the tolerances of test_mp_layers.py
            limit = 0 if what == "argmax_mismatches" else 1e-4 if what in ("loss", "nll", "plain_nll") else 1e-5
            assert value <= limit, f"{layer} {what}: {value}"


def test_expert_parallel_on_cuda_equals_single_process(tmp_path, lm_data):
    """E = 4 experts on 2 ranks (gloo, one GPU, DDP with ``device_ids``) vs 1 process, all on CUDA, with
    the flags of the CPU check (its first GPU run, without ``--moe-balance-scope global``, compared two
    different losses: 1.5e-4 apart after one update, as on the CPU)."""
    flags = ["--moe-expert-count", "4", "--moe-top-k", "2", *EXPERT_PARALLEL_EQUIVALENCE]
    outs = {world: tmp_path / f"w{world}.pt" for world in (1, 2)}
    run_many([["env", "TS_HARNESS_DEVICE=cuda", sys.executable, "-m", "tests.workers.dist_harness", outs[world],
               str(world), lm_data, *flags] for world in (1, 2)])
    one, two = (torch.load(outs[w], map_location="cpu") for w in (1, 2))
    assert one["losses"] == pytest.approx(two["losses"], abs=1e-5)
    assert one["norms"] == pytest.approx(two["norms"], rel=1e-5)
    for name, p in one["state"].items():
        assert torch.allclose(p, two["state"][name], atol=1e-5, rtol=0), name


def test_nccl_collectives_at_world_size_one(tmp_path):
    proc = run([sys.executable, "-m", "tests.workers.nccl_worker", rendezvous_url(tmp_path)], cwd=REPO)
    assert "ok" in proc.stdout


@pytest.fixture
def seed_as_rank():
    """``seed(rank)`` seeds the tracker as tensor-parallel rank ``rank`` of 2 (seed 7)."""
    torch.cuda.init()  # fairseq sets the device (and so creates the context) before seeding

    def seed(rank: int) -> None:
        model_parallel_seed(7, rank, 2)

    yield seed
    get_rng_tracker().reset()


def _fork_draw() -> torch.Tensor:
    with get_rng_tracker().fork():
        return torch.rand(8, device="cuda")


def test_rng_tracker_forks_cuda_generators(seed_as_rank, tmp_path):
    seed_as_rank(0)
    assert "cuda" in get_rng_tracker().state_dict()[tp_random.MODEL_PARALLEL_RNG]
    torch.cuda.manual_seed(0)
    default_state = torch.cuda.get_rng_state()
    saved = get_rng_tracker().state_dict()
    rank0 = _fork_draw()
    assert torch.equal(torch.cuda.get_rng_state(), default_state)  # fork leaves the default CUDA stream alone
    assert not torch.equal(rank0, torch.rand(8, device="cuda"))  # ... and draws from another one
    # saved in a checkpoint (plain tensors, loadable with weights_only) and restored: the same draws
    torch.save({"rng": saved}, tmp_path / "rng.pt")
    get_rng_tracker().load_state_dict(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    assert torch.equal(_fork_draw(), rank0)
    seed_as_rank(1)
    assert not torch.equal(_fork_draw(), rank0)  # every tensor-parallel rank has its own stream
