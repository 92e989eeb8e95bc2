"""fairseq-train through the real CLI for every model and backbone: the loss falls."""

import pytest

from tests.cli_utils import LM_TRAIN, MT_TRAIN, USER_DIR, json_logs, run, tool

BACKBONES = ["magneto", "deepnorm", "preln", "postln"]
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


@pytest.mark.parametrize("backbone", BACKBONES)
def test_lm_trains(lm_data, tmp_path, backbone):
    losses = train_losses(lm_data, "ts_lm_tiny", LM_TRAIN, backbone, tmp_path)
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("backbone", BACKBONES)
def test_translation_trains(mt_data, tmp_path, backbone):
    losses = train_losses(mt_data, "ts_transformer_tiny", MT_TRAIN, backbone, tmp_path)
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("backbone", BACKBONES)
def test_masked_lm_trains(lm_data, tmp_path, backbone):
    losses = train_losses(lm_data, "ts_mlm_tiny", MLM_TRAIN, backbone, tmp_path)
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses
