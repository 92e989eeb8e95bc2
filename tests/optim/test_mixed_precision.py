"""Mixed precision through ``fairseq-train`` on CPU (black box: the JSON training logs):
``--fp16`` (flat fp32 master), ``--memory-efficient-fp16``, ``--bf16`` and ``--amp`` for
the dense LM and the X-MoE + SparseClip LM track the fp32 run of the same seed.

Tolerances (4 updates, dropout 0, tiny model): the loss within 0.1% relative and ``gnorm``
within 1% for fp16 (loss-scaled half precision; measured at most 0.015% and 0.14%); 0.3% and
5% for bf16 (8-bit mantissa; measured 0.073% and 1.8%, the MoE gnorm); 0.1% and 2% for
``--amp``, which on the CPU autocasts the step to bfloat16 with fp32 weights
(:mod:`torchscale_fairseq.integration.cpu_autocast`; measured 0.044% and 0.65%). Every mode
must differ from fp32 somewhere (it really ran in reduced precision).
"""

from __future__ import annotations

import pytest

from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, json_logs, run_many, tool

UPDATES = 4
MODELS = {
    "dense": [],
    "moe_sparse_clip": ["--moe-expert-count", "4", "--moe-freq", "2", "--criterion", "moe_cross_entropy",
                        "--optimizer", "sparse_clip", "--sparse-clip-base", "adam", "--clip-norm", "0.5"],
}
MODES = {"fp32": [], "fp16": ["--fp16"], "memory_efficient_fp16": ["--memory-efficient-fp16"], "bf16": ["--bf16"],
         "amp": ["--amp"]}
TOLERANCE = {"fp16": (1e-3, 1e-2), "memory_efficient_fp16": (1e-3, 1e-2), "bf16": (3e-3, 5e-2), "amp": (1e-3, 2e-2)}


@pytest.fixture(scope="module")
def logs(lm_data, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("precision")
    runs = [(model, mode) for model in MODELS for mode in MODES]
    procs = run_many([[tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", *LM_TRAIN,
                       "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
                       "--decoder-attention-heads", "2", "--dropout", "0", "--log-interval", "1", "--max-update",
                       str(UPDATES), "--save-dir", root / f"{model}_{mode}", "--no-save", "--disable-validation",
                       "--num-workers", "0", *MODELS[model], *MODES[mode]] for model, mode in runs])
    return {run: json_logs(proc.stdout + proc.stderr, "train_inner") for run, proc in zip(runs, procs)}


@pytest.mark.parametrize("mode", [m for m in MODES if m != "fp32"])
@pytest.mark.parametrize("model", list(MODELS))
def test_mixed_precision_tracks_fp32(logs, model, mode):
    ref, got = logs[(model, "fp32")], logs[(model, mode)]
    assert len(ref) == len(got) == UPDATES
    loss_tol, gnorm_tol = TOLERANCE[mode]
    for step, (a, b) in enumerate(zip(ref, got), start=1):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=loss_tol), (step, a, b)
        assert float(b["gnorm"]) == pytest.approx(float(a["gnorm"]), rel=gnorm_tol), (step, a, b)
        if model == "moe_sparse_clip":
            assert float(b["gnorm_expert"]) > 0 and "moe_gate_loss" in b
    if mode in ("fp16", "memory_efficient_fp16"):
        assert all("loss_scale" in r for r in got)
    assert any(a["loss"] != b["loss"] or a["gnorm"] != b["gnorm"] for a, b in zip(ref, got)), \
        f"{mode} gave the fp32 numbers: it did not run in reduced precision"
