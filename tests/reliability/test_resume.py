"""SIGKILL in the middle of an epoch, restart the same command: the updates after the
restart are exactly those of an uninterrupted run (fp32 on CPU, one thread: bitwise).
Saves every 2 updates, killed after update 3: 2 updates on each side of the cut."""

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import torchscale_fairseq  # noqa: F401  (the checkpoint allow-list)
from tests.helpers import prewarmed
from tests.helpers.cli_utils import LM_TRAIN, MT_TRAIN, USER_DIR, WORKERS, cli_env, json_logs, run, tool

STALL_CLI = WORKERS / "stall_cli.py"
MAX_UPDATE, SAVE_EVERY = 4, 2
COMMON = ["--max-update", str(MAX_UPDATE), "--save-interval-updates", str(SAVE_EVERY), "--log-interval", "1",
          "--disable-validation", "--dropout", "0.1"]
RECIPES = {
    "ts_lm": ["--arch", "ts_lm_tiny", *LM_TRAIN, "--batch-size", "8", "--attention-dropout", "0.1"],
    "ts_transformer": ["--arch", "ts_transformer_tiny", *MT_TRAIN, "--max-tokens", "400"],
    "ts_lm_moe_sparse_clip": [
        "--arch", "ts_lm_tiny", *LM_TRAIN, "--batch-size", "8", "--moe-expert-count", "4", "--moe-freq", "2",
        "--moe-second-expert-policy", "random", "--moe-gate-noise", "0.0", "--criterion", "moe_cross_entropy",
        "--optimizer", "sparse_clip", "--sparse-clip-base", "adam", "--clip-norm", "0.5",
    ],
    "ts_lm_fine_grained_aux_free": [  # the expert biases are model state, moved after every update
        "--arch", "ts_lm_tiny", *LM_TRAIN, "--batch-size", "8", "--moe-expert-count", "8", "--moe-freq", "2",
        "--moe-top-k", "4", "--moe-expert-ffn-dim", "64", "--moe-shared-expert-count", "1",
        "--moe-router-bias-update-rate", "0.01", "--moe-gate-loss-wt", "0", "--criterion", "moe_cross_entropy",
    ],
}


def _command(data, save, recipe):
    return [tool("fairseq-train"), str(data), "--user-dir", USER_DIR, "--save-dir", str(save), *RECIPES[recipe],
            *COMMON]


def _kill_after(cmd, update: int) -> None:
    """Start ``cmd`` (a ``fairseq-train`` command) stalling after update ``update``; SIGKILL
    it once it has logged that update."""
    proc = prewarmed.popen([sys.executable, str(STALL_CLI), str(update), *cmd[1:]], subprocess.PIPE, env=cli_env(),
                           text=True)
    for line in proc.stdout:
        if "| train_inner |" in line and json.loads(line[line.find("{"):])["num_updates"] == str(update):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def _losses(text):
    return {int(r["num_updates"]): r["loss"] for r in json_logs(text, "train_inner")}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_sigkill_mid_epoch_then_restart_is_exact(recipe, lm_data, mt_data, tmp_path):
    data = mt_data if recipe == "ts_transformer" else lm_data
    with ThreadPoolExecutor(max_workers=2) as pool:  # the uninterrupted run alongside the killed one
        pending = pool.submit(run, _command(data, tmp_path / "ref", recipe))
        _kill_after(_command(data, tmp_path / "killed", recipe), update=SAVE_EVERY + 1)
        reference = pending.result()
    resumed = run(_command(data, tmp_path / "killed", recipe))
    out = resumed.stdout + resumed.stderr
    assert "Loaded checkpoint" in out and f"@ {SAVE_EVERY} updates" in out
    ref, got = _losses(reference.stdout + reference.stderr), _losses(out)
    assert sorted(got) == list(range(SAVE_EVERY + 1, MAX_UPDATE + 1))
    assert all(got[u] == ref[u] for u in got), (ref, got)
    state_ref = torch.load(tmp_path / "ref" / "checkpoint_last.pt", weights_only=True)
    state_got = torch.load(tmp_path / "killed" / "checkpoint_last.pt", weights_only=True)
    assert state_ref["model"].keys() == state_got["model"].keys()
    for name, value in state_ref["model"].items():
        assert torch.equal(value, state_got["model"][name]), name
    biases = [v for n, v in state_ref["model"].items() if n.endswith(".expert_bias")]
    assert ("--moe-router-bias-update-rate" in RECIPES[recipe]) == any(bool(b.abs().sum() > 0) for b in biases)
    ref_opt = state_ref["last_optimizer_state"]["state"]
    got_opt = state_got["last_optimizer_state"]["state"]
    for key in ref_opt:
        for field, value in ref_opt[key].items():
            if torch.is_tensor(value):
                assert torch.equal(value, got_opt[key][field]), (key, field)
