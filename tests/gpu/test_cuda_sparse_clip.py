"""X-MoE with SparseClip on CUDA in fairseq's real trainer (``tests.workers.dist_harness``):
under ``--fp16`` (one flat fp32 master) and ``--bf16`` (flat and per-parameter) the
clipped and logged norms are taken on unscaled gradients: the first clipped norm matches
the fp32 run's, and every logged ``gnorm`` follows the fp32 formula that
``tests/optim/test_sparse_clip_training.py`` checks on CPU (E = 4 experts, one rank)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from tests.helpers.cli_utils import run_many
from tests.optim.test_sparse_clip_training import MOE, SPARSE

pytestmark = pytest.mark.gpu

MODES = {"fp16": ["--fp16"], "bf16": ["--bf16"], "bf16-per-parameter": ["--bf16", "--fp16-no-flatten-grads"],
         "memory-efficient-fp16": ["--memory-efficient-fp16"]}
# The default second-expert policy (``random``) draws from the device's generator: CPU and CUDA
# would route differently (the first GPU run: first losses 0.3% apart). ``all`` routes the same.
SAME_ROUTES = ["--moe-second-expert-policy", "all"]
TOLERANCE = {"fp16": 1e-2, "memory-efficient-fp16": 1e-2, "bf16": 3e-2, "bf16-per-parameter": 3e-2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, lm_data) -> dict:
    """The fp32 runs on CPU and CUDA and every precision mode on CUDA, started together."""
    root = tmp_path_factory.mktemp("cuda_clip")
    names = ["fp32-cpu", "fp32", *MODES]
    cmds = []
    for name in names:
        device = "TS_HARNESS_DEVICE=" + ("cpu" if name == "fp32-cpu" else "cuda")
        cmds.append(["env", device, sys.executable, "-m", "tests.workers.dist_harness", root / f"{name}.pt", "1",
                     lm_data, *MOE, *SPARSE, *SAME_ROUTES, *MODES.get(name, [])])
    run_many(cmds)
    return {name: torch.load(root / f"{name}.pt", map_location="cpu") for name in names}


def test_fp32_on_cuda_equals_cpu(runs):
    cuda, cpu = runs["fp32"], runs["fp32-cpu"]
    assert (cuda["losses"][0], cuda["norms"][0]) == pytest.approx((cpu["losses"][0], cpu["norms"][0]), rel=1e-4)
    # later updates: Adam turns rounding-level differences of near-zero gradients into lr-sized steps
    assert cuda["losses"] == pytest.approx(cpu["losses"], rel=1e-3)
    assert cuda["norms"] == pytest.approx(cpu["norms"], rel=1e-3)


@pytest.mark.parametrize("mode", MODES)
def test_norms_are_taken_on_unscaled_gradients(runs, mode):
    ref, got = runs["fp32"], runs[mode]
    assert got["norms"][0] == pytest.approx(ref["norms"][0], rel=TOLERANCE[mode])
    for log in got["logged"]:
        dense, expert = log["gnorm_dense"], log["gnorm_expert"]
        assert expert > 0 and math.isfinite(log["gnorm"])
        assert log["gnorm"] == pytest.approx(math.sqrt(dense**2 + expert**2 / 4), abs=2e-3)
        assert log["clip"] == (100.0 if log["gnorm"] > 0.5 else 0.0)
