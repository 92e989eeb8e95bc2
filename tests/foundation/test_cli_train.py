"""fairseq-train through the real CLI for every model and backbone: the loss falls."""

import pytest

from tests.cli_utils import LM_TRAIN, MT_TRAIN, USER_DIR, json_logs, run, tool

MLM_TRAIN = [
    "--task", "masked_lm", "--criterion", "masked_lm", "--tokens-per-sample", "32", "--sample-break-mode", "none",
    "--optimizer", "adam", "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "5",
    "--batch-size", "16", "--cpu", "--log-format", "json", "--log-interval", "5", "--seed", "1",
]


def train_losses(data, arch, flags, backbone, tmp_path, updates=30):
    proc = run([tool("fairseq-train"), data, "--user-dir", USER_DIR, "--arch", arch, "--backbone", backbone,
                "--max-update", str(updates), "--save-dir", tmp_path / "ck", "--no-save", "--dropout", "0.0",
                "--disable-validation", *flags])
    return [float(r["train_inner_loss"] if "train_inner_loss" in r else r["loss"])
            for r in json_logs(proc.stdout + proc.stderr, "train_inner")]


# every model and every backbone at least once (every pair learns in-process in test_backbones_learn.py)
RUNS = [
    ("lm_data", "ts_lm_tiny", LM_TRAIN, "magneto"),
    ("lm_data", "ts_lm_tiny", LM_TRAIN, "postln"),
    ("mt_data", "ts_transformer_tiny", MT_TRAIN, "deepnorm"),
    ("mt_data", "ts_transformer_tiny", MT_TRAIN, "magneto"),
    ("lm_data", "ts_mlm_tiny", MLM_TRAIN, "preln"),
]


@pytest.mark.parametrize("data,arch,flags,backbone", RUNS, ids=[f"{r[1]}-{r[3]}" for r in RUNS])
def test_model_trains(request, tmp_path, data, arch, flags, backbone):
    losses = train_losses(request.getfixturevalue(data), arch, flags, backbone, tmp_path)
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses
