"""SparseClip inside fairseq's real ``Trainer`` (tests.workers.dist_harness): precision
modes that run on CPU, and equality with vanilla ``--clip-norm`` at E=1.

The distributed norms (expert-parallel E=4 and data-parallel E=1 replicas, 2 gloo ranks
vs 1 process) are asserted in ``tests/modules/moe/test_distributed.py``, which trains with
``--optimizer sparse_clip``. ``--bf16`` runs on CPU with ``--fp16-no-flatten-grads``
(fairseq 0.12 makes it a TPU run; the plugin clears that, see
``integration/bf16_device.py``); flattened ``--fp16`` runs on CPU too (fairseq's flat
master calls ``torch.cuda.current_device``; ``compat/cpu_mixed_precision.py`` builds it on
the CPU). Every precision mode against fp32 through ``fairseq-train``:
``test_mixed_precision.py``.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from tests.helpers.cli_utils import run_many

MOE = ["--moe-expert-count", "4", "--moe-freq", "1", "--criterion", "moe_cross_entropy", "--clip-norm", "0.5"]
SPARSE = ["--optimizer", "sparse_clip", "--sparse-clip-base", "adam"]


MODES = [["--memory-efficient-fp16"], ["--fp16"], ["--fp16", "--fp16-no-flatten-grads"], ["--amp"],
         ["--bf16", "--fp16-no-flatten-grads"]]
ONE_EXPERT = ["--moe-expert-count", "1", "--moe-top-k", "1", "--moe-freq", "1", "--criterion", "moe_cross_entropy",
              "--clip-norm", "0.3"]
RUNS = [(*MOE, *SPARSE), *[(*MOE, *SPARSE, *mode) for mode in MODES], (*ONE_EXPERT, "--optimizer", "adam"),
        (*ONE_EXPERT, *SPARSE)]


@pytest.fixture(scope="module")
def harness(tmp_path_factory, lm_data):
    """Every run of this module, made a few at a time up front; ``harness(*flags)`` gives one."""
    outs = [tmp_path_factory.mktemp("run") / "out.pt" for _ in RUNS]
    run_many([[sys.executable, "-m", "tests.workers.dist_harness", out, "1", lm_data, *flags]
              for out, flags in zip(outs, RUNS)])
    cache = {flags: torch.load(out) for flags, out in zip(RUNS, outs)}
    return lambda *flags: cache[flags]


@pytest.mark.parametrize("mode", MODES)
def test_precision_modes_take_the_norm_on_unscaled_gradients(harness, mode):
    ref = harness(*MOE, *SPARSE)
    got = harness(*MOE, *SPARSE, *mode)
    # bf16 keeps 8 mantissa bits: its forward differs from fp32 by ~1%, so does the norm
    assert got["norms"][0] == pytest.approx(ref["norms"][0], rel=3e-2 if "--bf16" in mode else 1e-2)
    for log in got["logged"]:
        dense, expert = log["gnorm_dense"], log["gnorm_expert"]
        assert expert > 0
        assert log["gnorm"] == pytest.approx(math.sqrt(dense**2 + expert**2 / 4), abs=2e-3)
        assert log["clip"] == (100.0 if log["gnorm"] > 0.5 else 0.0)


def test_one_expert_equals_vanilla_clip_norm(harness):
    vanilla = harness(*ONE_EXPERT, "--optimizer", "adam")
    sparse = harness(*ONE_EXPERT, *SPARSE)
    assert sparse["norms"] == vanilla["norms"]
    assert sparse["norms"][0] > 0.3
    for name, p in vanilla["state"].items():
        assert torch.equal(p, sparse["state"][name]), name
