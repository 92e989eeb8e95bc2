"""SIGKILL both ranks of a tensor-parallel (N=2) run mid-epoch, restart: the updates after
the restart equal those of an uninterrupted N=2 run, the checkpoint parts bitwise. Dropout
and attention dropout are on, so the tensor-parallel RNG tracker must come back too.

The uninterrupted run also shows Megatron's replication invariant with dropout on: after
its 12 updates every tensor the parameter-attribute registry does not mark as split
(LayerNorms, row-parallel biases), with its Adam moments, is bitwise identical in the two
ranks' parts, and every split one differs (the per-rank dropout streams of
``model_parallel/random.py`` stay inside the parallel regions).

A kill between the two ranks' writes of ``checkpoint_last`` leaves parts of different
updates: the restart is refused in one line naming the newest complete checkpoint (ranks
resuming from different updates would wait on each other forever), and resuming from it
is exact too."""

import json
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

import torchscale_fairseq  # noqa: F401  (the checkpoint allow-list)
from tests.cli_utils import LM_TRAIN
from tests.model_parallel.mp_helpers import (
    BIN,
    USER_DIR,
    assert_replicated_across_parts,
    dist_flags,
    launch,
    run_fairseq,
)
from tests.rendezvous import rendezvous_url

STALL_CLI = Path(__file__).resolve().parent / "stall_cli.py"

ARGS = ["--arch", "ts_lm_tiny", *LM_TRAIN, "--batch-size", "8", "--max-update", "12", "--save-interval-updates", "4",
        "--log-interval", "1", "--disable-validation", "--dropout", "0.1", "--attention-dropout", "0.1",
        "--model-parallel-size", "2", "--ddp-backend", "legacy_ddp"]
ARGS.remove("--cpu")


def _losses(log) -> dict:
    out = {}
    for line in log.read_text().splitlines():
        if "| train_inner |" in line:
            record = json.loads(line[line.index("{"):])
            out[int(record["num_updates"])] = record["loss"]
    return out


def _kill_after(args, out, update: int) -> None:
    """Run ``fairseq-train`` on 2 ranks that stall once ``update`` updates are logged; SIGKILL both."""
    init_method = rendezvous_url(out)
    procs = [launch([sys.executable, str(STALL_CLI), str(update), *args, "--user-dir", str(USER_DIR), "--cpu",
                     *dist_flags(2, rank, init_method)], out / f"fairseq-train.{rank}.log") for rank in range(2)]
    log = out / "fairseq-train.0.log"
    deadline = time.monotonic() + 600
    while update not in _losses(log):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log.read_text()[-3000:]
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()


def _assert_resumed_exactly(ref_dir, run_dir, ref_log, resumed_log, from_update: int) -> None:
    text = resumed_log.read_text()
    assert "Loaded checkpoint" in text and f"@ {from_update} updates" in text
    want, got = _losses(ref_log), _losses(resumed_log)
    assert sorted(got) == list(range(from_update + 1, 13))
    assert all(got[u] == want[u] for u in got), (want, got)
    for part in (0, 1):
        a = torch.load(ref_dir / f"checkpoint_last-model_part-{part}.pt", weights_only=True)["model"]
        b = torch.load(run_dir / f"checkpoint_last-model_part-{part}.pt", weights_only=True)["model"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tensor_parallel_sigkill_then_restart_is_exact(lm_data, tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = run_fairseq("fairseq-train", [str(lm_data), "--save-dir", str(ref_dir), *ARGS], 2, tmp_path / "ref_logs")
    replicated = assert_replicated_across_parts([ref_dir / f"checkpoint_last-model_part-{k}.pt" for k in (0, 1)])
    assert any("layer_norm" in key for key in replicated), replicated
    assert any(key.endswith("out_proj.bias") for key in replicated), replicated
    assert any(key.endswith("fc2.bias") for key in replicated), replicated
    _kill_after([str(lm_data), "--save-dir", str(run_dir), *ARGS], tmp_path / "killed_logs", update=6)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        f"checkpoint_{n}-model_part-{k}.pt" for n in ("1_4", "last") for k in (0, 1)]
    resumed = run_fairseq("fairseq-train", [str(lm_data), "--save-dir", str(run_dir), *ARGS], 2,
                          tmp_path / "resumed_logs")
    _assert_resumed_exactly(ref_dir, run_dir, ref[0], resumed[0], from_update=4)

    # killed while saving update 8: part 0 of checkpoint_last and of checkpoint_1_8 written, part 1 not
    torn_dir = tmp_path / "torn"
    torn_dir.mkdir()
    for name in ("checkpoint_1_4-model_part-0.pt", "checkpoint_1_4-model_part-1.pt", "checkpoint_1_8-model_part-0.pt"):
        shutil.copy(ref_dir / name, torn_dir / name)
    shutil.copy(ref_dir / "checkpoint_1_8-model_part-0.pt", torn_dir / "checkpoint_last-model_part-0.pt")
    shutil.copy(ref_dir / "checkpoint_1_4-model_part-1.pt", torn_dir / "checkpoint_last-model_part-1.pt")
    args = [str(lm_data), "--save-dir", str(torn_dir), *ARGS]
    logs = fairseq_ranks_failing(args, tmp_path / "torn_logs")
    restore = torn_dir / "checkpoint_1_4.pt"
    for log in logs:
        errors = [ln for ln in log.read_text().splitlines() if "different updates" in ln]
        assert errors and f"--restore-file {restore}" in errors[-1], log.read_text()[-2000:]
        assert "@ 8" in errors[-1] and "@ 4" in errors[-1]
    resumed = run_fairseq("fairseq-train", [*args, "--restore-file", str(restore)], 2, tmp_path / "restored_logs")
    _assert_resumed_exactly(ref_dir, torn_dir, ref[0], resumed[0], from_update=4)


def fairseq_ranks_failing(args, out) -> list[Path]:
    """Run ``fairseq-train`` on 2 ranks that must both exit with an error (within the timeout)."""
    init_method = rendezvous_url(out)
    logs = [out / f"fairseq-train.{rank}.log" for rank in range(2)]
    procs = [launch([str(BIN / "fairseq-train"), *args, "--user-dir", str(USER_DIR), "--cpu",
                     *dist_flags(2, rank, init_method)], logs[rank]) for rank in range(2)]
    for p, log in zip(procs, logs):
        assert p.wait(timeout=300) != 0, log.read_text()[-2000:]
    return logs
