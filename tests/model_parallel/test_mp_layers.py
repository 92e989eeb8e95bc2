"""Layer level, N = 2 on gloo: every parallel layer equals its dense PyTorch counterpart
built from the same full weights (forward and backward, 1e-5 of the reference's scale), the vocabulary-parallel
cross-entropy equals fairseq's label-smoothed loss on the full logits, the fused output layer +
cross-entropy equals the dense output layer and ``F.cross_entropy``, and a layer makes
exactly 2 large all-reduces forward and 2 backward (Megatron-LM section 3); selective
recomputation of the attention core with attention dropout drawn from the tracker streams
gives the gradients of no recomputation, keeps none of the rank's scores and adds no
collective; an X-MoE layer under sequence parallelism on a padded batch equals the unsplit
layer (output slice, balance loss, gradients)."""

from __future__ import annotations

import pytest

from tests.helpers.cli_utils import WORKERS
from tests.helpers.mp_helpers import run_worker_ranks

WORKER = WORKERS / "layer_worker.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_worker_ranks(WORKER, 2, tmp_path_factory.mktemp("layers"))


@pytest.mark.parametrize("layer", ["column", "row", "embedding", "layernorm", "magneto", "preln", "sp_magneto",
                                   "sp_preln", "sp_moe"])
def test_parallel_layer_equals_dense(results, layer):
    errors = results["errors"][layer]
    assert errors, layer
    for what, value in errors.items():
        assert value <= TOL, f"{layer} {what}: max abs error {value}"


def test_vocab_parallel_cross_entropy_equals_dense(results):
    errors = results["errors"]["cross_entropy"]
    assert errors["argmax_mismatches"] == 0
    for what in ("loss", "nll", "plain_nll", "grad_logits"):
        assert errors[what] <= 1e-4 if what != "grad_logits" else errors[what] <= TOL, (what, errors[what])


def test_cross_entropy_communicates_per_token_scalars(results):
    b, t, _ = results["shape"]
    log = results["collectives"]["cross_entropy"]
    assert [tuple(entry) for entry in log] == [("all_reduce", "forward", b * t), ("all_reduce", "forward", 3 * b * t)]


def test_fused_linear_cross_entropy_equals_dense(results):
    """Output layer + loss fused in chunks of 4 rows on each rank's vocabulary slice: the dense loss and
    gradients; per chunk two all-reduces of per-token scalars forward, one of the features' gradient back."""
    errors = results["errors"]["linear_cross_entropy"]
    for what in ("loss", "grad_hidden", "grad_weight"):
        assert errors[what] <= 1e-4 if what == "loss" else errors[what] <= TOL, (what, errors[what])
    b, t, d = results["shape"]
    rows = [min(4, b * t - i) for i in range(0, b * t, 4)]
    expected = [e for n in rows for e in (("all_reduce", "forward", n), ("all_reduce", "forward", 2 * n))]
    expected.append(("all_reduce", "backward", b * t * d))
    assert [tuple(entry) for entry in results["collectives"]["linear_cross_entropy"]] == expected


def _count(log, direction, numel):
    return [n for o, d, n in log if o == "all_reduce" and d == direction and n == numel]


@pytest.mark.parametrize("backbone,stats", [("magneto", 4), ("preln", 0)])
def test_two_large_all_reduces_each_way_per_layer(results, backbone, stats):
    b, t, d = results["shape"]
    log = results["collectives"][backbone]
    assert len(_count(log, "forward", b * t * d)) == 2  # g: row-parallel outputs
    assert len(_count(log, "backward", b * t * d)) == 2  # f: column-parallel input gradients
    # Magneto's two inner LayerNorms: mean and variance, per-token scalars, each way
    assert len(_count(log, "forward", b * t)) == stats
    assert len(_count(log, "backward", b * t)) == stats
    assert len(log) == 4 + 2 * stats


@pytest.mark.parametrize("backbone,stats", [("magneto", 4), ("preln", 0)])
def test_sequence_parallel_layer_gathers_and_reduce_scatters(results, backbone, stats):
    """Korthikanti et al. 2022, Fig. 5 and section 4.2.2: per layer, forward an all-gather
    before each column-parallel block and a reduce-scatter after each row-parallel one;
    backward the mirror, plus one all-gather per column-parallel block that gathers its
    input again (only the rank's slice is kept); no all-reduce of activations (only
    Magneto's per-token LN statistics)."""
    b, t, d = results["sp_shape"]
    log = [tuple(entry) for entry in results["collectives"][f"sp_{backbone}"]]
    for direction, gathers in (("forward", 2), ("backward", 4)):
        assert log.count(("all_gather_single", direction, b * t * d // 2)) == gathers, log
        assert log.count(("reduce_scatter_single", direction, b * t * d)) == 2, log
        assert log.count(("all_reduce", direction, b * t)) == stats, log
    assert len(log) == 10 + 2 * stats, log


def test_sequence_parallel_moe_layer_gathers_the_sequence_once_each_way(results):
    """An X-MoE layer under sequence parallelism all-gathers the sequence at its entry
    (forward) and the output gradient at its exit (backward), besides attention's
    gathers and reduce-scatters; inside, the split experts communicate as under plain
    tensor parallelism: ``g`` on the ``2 N`` routed rows of the ``N`` non-padding tokens forward
    (one GEMM per expert: the kept rows only), ``f`` on the gradient of all ``B T`` tokens backward
    (the routing keeps fixed shapes: padding tokens are routed nowhere, not removed)."""
    b, t, d = results["sp_shape"]
    log = [tuple(entry) for entry in results["collectives"]["sp_moe"]]
    for direction, gathers in (("forward", 2), ("backward", 3)):
        assert log.count(("all_gather_single", direction, b * t * d // 2)) == gathers, log
        assert log.count(("reduce_scatter_single", direction, b * t * d)) == 1, log
    tokens = b * t - 2  # the worker's padding mask covers two positions
    assert log.count(("all_reduce", "forward", 2 * tokens * d)) == 1, log
    assert log.count(("all_reduce", "backward", b * t * d)) == 1, log


def test_dropout_masks_differ_inside_the_parallel_region_only(results):
    """Megatron-LM's RNG tracker: attention dropout on a rank's own heads and activation
    dropout on its own FFN slice draw from a per-rank stream (different masks on the two
    ranks), residual dropout from the default generator (the same mask on both, so the
    replicated activations stay identical), and the default generator leaves the layer in
    the same state on both ranks. Control: with the tracker reset every mask is shared,
    so the difference comes from the tracker and not from the layer's inputs."""
    masks = results["dropout_masks"]
    tracked, untracked = masks["tracked"], masks["untracked"]
    assert set(tracked) == set(untracked) == {"attention", "activation", "residual", "default_generator_after"}
    assert {kind: entry["count"] for kind, entry in tracked.items()} == {
        "attention": 1, "activation": 1, "residual": 2, "default_generator_after": 1}
    assert tracked["attention"]["same"] == [False]
    assert tracked["activation"]["same"] == [False]
    assert tracked["residual"]["same"] == [True, True]
    assert tracked["default_generator_after"]["same"] == [True]
    assert all(all(entry["same"]) for entry in untracked.values()), untracked


@pytest.mark.parametrize("key,shape", [("selective", "shape"), ("selective_sp", "sp_shape")], ids=["tp", "tp+sp"])
def test_selective_recompute_equals_no_recompute(results, key, shape):
    """Bitwise: the recomputation replays the rank's tracker stream. Saved bytes drop by the
    rank's ``B (h/N) T^2`` scores, three fp32 tensors on CPU (softmax output, dropout mask,
    dropped scores; Korthikanti et al. 2022, section 5: ``5as^2b/t`` in 16-bit), with
    sequence parallelism too (the core sees the whole sequence)."""
    b, t, _ = results[shape]
    selective = results[key]
    assert (selective["out"], selective["grad_x"], selective["grad_params"]) == (0.0, 0.0, 0.0), selective
    assert selective["saved_bytes_less"] == (4 + 4 + 4) * b * (results["heads"] // 2) * t * t
    assert selective["collectives_more"] == 0
