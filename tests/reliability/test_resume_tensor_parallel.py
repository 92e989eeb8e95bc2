"""SIGKILL both ranks of a tensor-parallel (N=2) run mid-epoch, restart: the updates after
the restart equal those of an uninterrupted N=2 run, the checkpoint parts bitwise. Dropout
and attention dropout are on, so the tensor-parallel RNG tracker must come back too."""

import json
import signal
import time

import torch

import torchscale_fairseq  # noqa: F401  (the checkpoint allow-list)
from tests.cli_utils import LM_TRAIN
from tests.model_parallel.mp_helpers import fairseq_ranks, run_fairseq

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
    logs = fairseq_ranks("fairseq-train", args, 2, out)
    procs = fairseq_ranks.procs
    deadline = time.monotonic() + 600
    while update not in _losses(logs[0]):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()


def test_tensor_parallel_sigkill_then_restart_is_exact(lm_data, tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = run_fairseq("fairseq-train", [str(lm_data), "--save-dir", str(ref_dir), *ARGS], 2, tmp_path / "ref_logs")
    _kill_after([str(lm_data), "--save-dir", str(run_dir), *ARGS], tmp_path / "killed_logs", update=6)
    resumed = run_fairseq("fairseq-train", [str(lm_data), "--save-dir", str(run_dir), *ARGS], 2,
                          tmp_path / "resumed_logs")
    text = resumed[0].read_text()
    assert "Loaded checkpoint" in text and "@ 4 updates" in text
    want, got = _losses(ref[0]), _losses(resumed[0])
    assert sorted(got) == list(range(5, 13))
    assert all(got[u] == want[u] for u in got), (want, got)
    for part in (0, 1):
        a = torch.load(ref_dir / f"checkpoint_last-model_part-{part}.pt", weights_only=True)["model"]
        b = torch.load(run_dir / f"checkpoint_last-model_part-{part}.pt", weights_only=True)["model"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
