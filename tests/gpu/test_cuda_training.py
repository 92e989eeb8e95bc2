"""fairseq-train on CUDA for every model x backbone in fp32, ``--fp16``,
``--memory-efficient-fp16``, ``--bf16`` and ``--amp`` (fairseq's ``torch.autocast`` fp16 with a
``GradScaler``, which the CPU tests cannot run: autocast is off there): the loss falls and stays
finite; every reduced precision tracks fp32 at the first logged update and differs from it
somewhere (it really ran in reduced precision), and fp16 / amp log their loss scale."""

from __future__ import annotations

import math

import pytest

from tests.helpers.cli_utils import LM_TRAIN, MT_TRAIN, USER_DIR, json_logs, run_many, tool
from tests.models.test_cli_train import MLM_TRAIN

pytestmark = pytest.mark.gpu

MODELS = {"ts_lm_tiny": ("lm_data", LM_TRAIN), "ts_transformer_tiny": ("mt_data", MT_TRAIN),
          "ts_mlm_tiny": ("lm_data", MLM_TRAIN)}
BACKBONES = ("magneto", "deepnorm", "preln", "postln")
PRECISIONS = {"fp32": [], "fp16": ["--fp16"], "memory-efficient-fp16": ["--memory-efficient-fp16"],
              "bf16": ["--bf16"], "amp": ["--amp"]}
# relative difference allowed from fp32 in the loss of update 1 (the first logged record). Every update
# is logged: fairseq rounds losses to 3 decimals, under which a tiny model's fp16 run can match fp32
# for the 6 records of --log-interval 5 (seen for ts_mlm_tiny on an H100); over 30 updates it cannot.
FIRST_LOSS_TOLERANCE = {"fp16": 2e-2, "memory-efficient-fp16": 2e-2, "bf16": 5e-2, "amp": 2e-2}
RUNS = [(arch, backbone, precision) for arch in MODELS for backbone in BACKBONES for precision in PRECISIONS]


def on_cuda(flags: list[str]) -> list[str]:
    """The CPU test flags without ``--cpu``."""
    return [f for f in flags if f != "--cpu"]


@pytest.fixture(scope="module")
def losses(request, tmp_path_factory) -> dict:
    """``train_inner`` records of every run (30 updates each, as on CPU, each logged; as many at once as there are
    cores: one GPU holds them all, and most of each run is fairseq's start-up)."""
    root = tmp_path_factory.mktemp("cuda_train")
    cmds = []
    for arch, backbone, precision in RUNS:
        data, flags = MODELS[arch]
        cmds.append([tool("fairseq-train"), request.getfixturevalue(data), "--user-dir", USER_DIR, "--arch", arch,
                     "--backbone", backbone, "--max-update", "30", "--no-save", "--dropout", "0.0",
                     "--save-dir", root / f"{arch}-{backbone}-{precision}", "--disable-validation",
                     *on_cuda(flags), "--log-interval", "1", *PRECISIONS[precision]])
    procs = run_many(cmds)
    out = {}
    for run, proc in zip(RUNS, procs):
        text = proc.stdout + proc.stderr
        assert "CUDA enviroments for all 1 workers" in text, f"{run} did not train on CUDA"  # fairseq's spelling
        out[run] = json_logs(text, "train_inner")
    return out


@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_trains_on_cuda(losses, run):
    got = [float(r["loss"]) for r in losses[run]]
    assert len(got) >= 5 and all(math.isfinite(x) for x in got), got
    assert got[-1] < got[0] - 0.5, got


REDUCED = [r for r in RUNS if r[2] != "fp32"]


@pytest.mark.parametrize("run", REDUCED, ids=["-".join(r) for r in REDUCED])
def test_reduced_precision_tracks_fp32(losses, run):
    arch, backbone, precision = run
    ref = [float(r["loss"]) for r in losses[(arch, backbone, "fp32")]]
    records = losses[run]
    got = [float(r["loss"]) for r in records]
    assert got[0] == pytest.approx(ref[0], rel=FIRST_LOSS_TOLERANCE[precision]), (got, ref)
    assert got != ref, f"{precision} gave the fp32 losses: it did not run in reduced precision"
    if precision in ("fp16", "memory-efficient-fp16", "amp"):
        assert all("loss_scale" in r for r in records), records[0]
