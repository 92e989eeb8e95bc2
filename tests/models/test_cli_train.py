"""fairseq-train through the real CLI for every model and backbone: the loss falls."""

import pytest

from tests.helpers.cli_utils import LM_TRAIN, MT_TRAIN, USER_DIR, json_logs, run_many, tool

MLM_TRAIN = [
    "--task", "masked_lm", "--criterion", "masked_lm", "--tokens-per-sample", "32", "--sample-break-mode", "none",
    "--optimizer", "adam", "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "5",
    "--batch-size", "16", "--cpu", "--log-format", "json", "--log-interval", "5", "--seed", "1",
]


# every model and every backbone at least once (every pair learns in-process in test_backbones_learn.py)
RUNS = [
    ("lm_data", "ts_lm_tiny", LM_TRAIN, "magneto"),
    ("lm_data", "ts_lm_tiny", LM_TRAIN, "postln"),
    ("mt_data", "ts_transformer_tiny", MT_TRAIN, "deepnorm"),
    ("mt_data", "ts_transformer_tiny", MT_TRAIN, "magneto"),
    ("lm_data", "ts_mlm_tiny", MLM_TRAIN, "preln"),
]
IDS = [f"{r[1]}-{r[3]}" for r in RUNS]


@pytest.fixture(scope="module")
def losses(request, tmp_path_factory) -> dict:
    """The ``train_inner`` losses of every run (30 updates, run a few at a time)."""
    root = tmp_path_factory.mktemp("cli_train")
    cmds = [[tool("fairseq-train"), request.getfixturevalue(data), "--user-dir", USER_DIR, "--arch", arch,
             "--backbone", backbone, "--max-update", "30", "--save-dir", root / name, "--no-save", "--dropout", "0.0",
             "--disable-validation", *flags] for name, (data, arch, flags, backbone) in zip(IDS, RUNS)]
    return {name: [float(r["train_inner_loss"] if "train_inner_loss" in r else r["loss"])
                   for r in json_logs(proc.stdout + proc.stderr, "train_inner")]
            for name, proc in zip(IDS, run_many(cmds))}


@pytest.mark.parametrize("name", IDS)
def test_model_trains(losses, name):
    assert len(losses[name]) >= 5 and losses[name][-1] < losses[name][0] - 0.5, losses[name]
