"""Faults: non-finite gradients, a dead rank, a full disk, a kill during a checkpoint copy."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import prewarmed
from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, WORKERS, cli_env, last_error_line, run, tool
from tests.helpers.rendezvous import rendezvous_url

TRAIN = [*LM_TRAIN, "--arch", "ts_lm_tiny", "--disable-validation", "--log-interval", "1"]


@pytest.mark.parametrize("precision", [[], ["--memory-efficient-fp16"]], ids=["fp32", "memory-efficient-fp16"])
def test_nonfinite_gradients_skip_one_update_and_training_goes_on(lm_data, tmp_path, precision):
    proc = run([sys.executable, WORKERS / "inject_nonfinite.py", "2", lm_data, "--user-dir", USER_DIR, "--save-dir",
                tmp_path, "--max-update", "4", "--no-save", *TRAIN, *precision])
    steps = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("STEP ")]
    out = proc.stdout + proc.stderr
    assert "gradient overflow detected, ignoring gradient" in out
    injected = [s for s in steps if s["injected"]]
    assert len(injected) == 1
    (upd_b, sum_b, scale_b, state_b, _), (upd_a, sum_a, scale_a, state_a, _) = injected[0]["before"], injected[0]["after"]
    assert upd_a == upd_b and sum_a == sum_b and state_a == state_b  # no update counted, nothing changed
    if precision:
        assert scale_a == scale_b / 2  # the fp16 loss scale adapts
    assert steps[-1]["after"][0] == 4  # training went on to --max-update
    assert all(s["after"][0] == s["before"][0] + 1 for s in steps if not s["injected"])


def test_a_dead_rank_makes_the_others_exit_quickly(lm_data, tmp_path):
    cmd = [tool("fairseq-train"), str(lm_data), "--user-dir", USER_DIR, "--save-dir", str(tmp_path), "--no-save",
           *TRAIN, "--max-update", "100000", "--distributed-backend", "gloo", "--distributed-world-size", "2",
           "--distributed-init-method", rendezvous_url(tmp_path), "--distributed-no-spawn", "--ddp-backend",
           "legacy_ddp", "--heartbeat-timeout", "30"]
    rank0 = prewarmed.popen([*cmd, "--distributed-rank", "0"], subprocess.PIPE, env=cli_env(), text=True)
    with open(os.devnull, "w") as devnull:
        rank1 = prewarmed.popen([*cmd, "--distributed-rank", "1"], devnull, env=cli_env())
    for line in rank0.stdout:
        if '"num_updates": "2"' in line:
            break
    rank1.send_signal(signal.SIGKILL)
    rank1.wait()
    killed_at = time.monotonic()
    try:
        rank0.communicate(timeout=120)
    finally:
        rank0.kill()
    assert rank0.returncode not in (0, None)
    assert time.monotonic() - killed_at < 120


def test_full_disk_at_first_save_is_one_clear_line(lm_data, tmp_path):
    save = tmp_path / "ck"
    save.mkdir()
    (save / "checkpoint_last.pt.tmp").symlink_to("/dev/full")  # every write there fails with ENOSPC
    proc = run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--save-dir", save, *TRAIN,
                "--max-update", "2"], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    line = last_error_line(proc)
    assert "cannot write checkpoint" in line and "--save-dir" in line and "No space left" in line
    assert not (save / "checkpoint_last.pt").exists()


def test_interrupted_copy_keeps_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    """A kill while checkpoint_last.pt is being refreshed leaves the old one intact."""
    from fairseq.file_io import PathManager

    import torchscale_fairseq  # noqa: F401

    last = tmp_path / "checkpoint_last.pt"
    torch.save({"model": {"w": torch.zeros(3)}}, last)
    new = tmp_path / "checkpoint_7.pt"
    torch.save({"model": {"w": torch.ones(3)}}, new)

    def dies_halfway(src, dst):
        Path(dst).write_bytes(Path(src).read_bytes()[:20])
        raise KeyboardInterrupt  # stands for the SIGKILL arriving mid-copy

    monkeypatch.setattr(shutil, "copyfile", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        PathManager.copy(str(new), str(last), overwrite=True)
    assert torch.equal(torch.load(last, weights_only=True)["model"]["w"], torch.zeros(3))
    monkeypatch.undo()
    assert PathManager.copy(str(new), str(last), overwrite=True)
    assert torch.equal(torch.load(last, weights_only=True)["model"]["w"], torch.ones(3))
