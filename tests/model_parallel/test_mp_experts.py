"""Experts split by tensor parallelism, layer level, 4 gloo ranks (TP = 2 x DP = 2, experts
over the 2 data-parallel ranks): every rank's MoE layer, with split and with replicated
experts, equals the single-process layer built from the same seed (forward, backward,
balance loss, router and expert gradients, the expert part of the gradient norm: 1e-5);
a split rank holds 1/2 of the expert parameters but the replicated ``fc2`` bias, and the
checkpoint layout records the split dimensions; a state of one mode loaded into a model of
the other, or an expert FFN width the tensor-parallel size does not divide, is one line."""

from __future__ import annotations

import pytest

from tests.helpers.cli_utils import WORKERS
from tests.helpers.mp_helpers import run_worker_ranks

WORKER = WORKERS / "expert_worker.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_worker_ranks(WORKER, 4, tmp_path_factory.mktemp("experts"))


CASES = ["magneto/split", "magneto/replicate", "swiglu/split", "swiglu/replicate"]


@pytest.mark.parametrize("case", CASES)
def test_layer_equals_single_process(results, case):
    for rank, per_rank in enumerate(results["ranks"]):
        for what, value in per_rank[case]["errors"].items():
            assert value <= TOL, f"rank {rank} {case} {what}: {value}"


@pytest.mark.parametrize("config,parts,subln", [("magneto", 1, True), ("swiglu", 2, False)])
def test_split_expert_parameters_per_rank(results, config, parts, subln):
    d, f, tp = results["dim"], results["ffn"], results["tp"]
    local = results["experts"] // (results["world"] // tp)
    # fc1 (d x parts f) + its bias, fc2 (f x d), Sub-LN affine (2 f): split; fc2 bias (d): replicated
    whole = local * (parts * f * d + parts * f + f * d + 2 * f * subln + d)
    split = local * ((parts * f * d + parts * f + f * d + 2 * f * subln) // tp + d)
    for per_rank in results["ranks"]:
        assert per_rank[f"{config}/replicate"]["expert_params"] == whole
        assert per_rank[f"{config}/split"]["expert_params"] == split


def test_layout_records_split_expert_dimensions(results):
    for per_rank in results["ranks"]:
        assert per_rank["magneto/split"]["layout"] == {
            "experts.fc1_bias": 1, "experts.fc1_weight": 2, "experts.fc2_weight": 1,
            "experts.ln_bias": 1, "experts.ln_weight": 1,
        }
        assert per_rank["magneto/replicate"]["layout"] == {}


@pytest.mark.parametrize("mode,saved", [("split", "replicate"), ("replicate", "split")])
def test_loading_the_other_mode_is_one_line(results, mode, saved):
    for per_rank in results["ranks"]:
        message = per_rank["messages"][mode]
        assert f"use --moe-expert-tensor-parallel {saved}" in message and "\n" not in message, message


def test_ffn_width_not_divisible_is_one_line(results):
    message = results["ranks"][0]["odd_ffn"]
    assert f"({results['ffn'] + 1}) is not divisible by --model-parallel-size 2" in message and "\n" not in message


def test_activation_dropout_keeps_the_tensor_parallel_ranks_in_step(results):
    """Split: dropout on each rank's features draws from its own stream (Megatron's tracker),
    the default generator stays identical on the TP ranks; replicate: the default generator,
    the same on every TP rank. Either way the layer output is identical on the TP ranks."""
    for per_rank in results["ranks"]:
        assert per_rank["dropout"]["split"] == {"default_rng_in_sync": True, "same_output": True,
                                                "tracker_used": True}
        assert per_rank["dropout"]["replicate"] == {"default_rng_in_sync": True, "same_output": True,
                                                    "tracker_used": False}
