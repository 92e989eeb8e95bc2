"""fairseq-train on CUDA for every model x backbone in fp32, ``--fp16``,
``--memory-efficient-fp16`` and ``--bf16``: the loss falls and stays finite."""

from __future__ import annotations

import math

import pytest

from tests.cli_utils import LM_TRAIN, MT_TRAIN, USER_DIR, json_logs, run_many, tool
from tests.foundation.test_cli_train import MLM_TRAIN

pytestmark = pytest.mark.gpu

MODELS = {"ts_lm_tiny": ("lm_data", LM_TRAIN), "ts_transformer_tiny": ("mt_data", MT_TRAIN),
          "ts_mlm_tiny": ("lm_data", MLM_TRAIN)}
BACKBONES = ("magneto", "deepnorm", "preln", "postln")
PRECISIONS = {"fp32": [], "fp16": ["--fp16"], "memory-efficient-fp16": ["--memory-efficient-fp16"],
              "bf16": ["--bf16"]}
RUNS = [(arch, backbone, precision) for arch in MODELS for backbone in BACKBONES for precision in PRECISIONS]


def on_cuda(flags: list[str]) -> list[str]:
    """The CPU test flags without ``--cpu``."""
    return [f for f in flags if f != "--cpu"]


@pytest.fixture(scope="module")
def losses(request, tmp_path_factory) -> dict:
    """``train_inner`` losses of every run (30 updates each, as on CPU, all started together: one GPU
    holds them all, and most of each run is fairseq's start-up)."""
    root = tmp_path_factory.mktemp("cuda_train")
    cmds = []
    for arch, backbone, precision in RUNS:
        data, flags = MODELS[arch]
        cmds.append([tool("fairseq-train"), request.getfixturevalue(data), "--user-dir", USER_DIR, "--arch", arch,
                     "--backbone", backbone, "--max-update", "30", "--no-save", "--dropout", "0.0",
                     "--save-dir", root / f"{arch}-{backbone}-{precision}", "--disable-validation",
                     *on_cuda(flags), *PRECISIONS[precision]])
    procs = run_many(cmds)
    out = {}
    for run, proc in zip(RUNS, procs):
        text = proc.stdout + proc.stderr
        assert "CUDA enviroments for all 1 workers" in text, f"{run} did not train on CUDA"  # fairseq's spelling
        out[run] = [float(r["loss"]) for r in json_logs(text, "train_inner")]
    return out


@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_trains_on_cuda(losses, run):
    got = losses[run]
    assert len(got) >= 5 and all(math.isfinite(x) for x in got), got
    assert got[-1] < got[0] - 0.5, got
