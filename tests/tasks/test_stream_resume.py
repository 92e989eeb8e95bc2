"""Exact mid-epoch resume of ``streaming_lm`` and ``streaming_mlm`` through ``fairseq-train``.

A run SIGKILLed right after a mid-epoch checkpoint (``--save-interval-updates``) and
restarted logs the same per-update losses and ends with the same parameters as an
uninterrupted run (fp32 on CPU, one thread: bitwise), single process with ``--num-workers``
0 and 2 and on 2 gloo data-parallel ranks; the restart reads no batch again. Also: resuming
from an epoch-end checkpoint, a changed ``--batches-per-epoch``, and states of older versions.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import torchscale_fairseq  # noqa: F401  (the checkpoint allow-list)
from data_prep import train_spm
from tests.helpers import prewarmed
from tests.helpers.cli_utils import WORKERS, cli_env, json_logs, tool
from tests.helpers.rendezvous import rendezvous_url
from tests.helpers.stream_data import make_stream_data
from tests.tasks.conftest import USER_DIR, batches
from torchscale_fairseq.errors import TsConfigError

STALL_CLI = WORKERS / "stall_cli.py"
EPOCH, SAVE_EVERY, MAX_UPDATE = 4, 3, 6  # kill after the checkpoint of update 3, mid-epoch 1
COMMON = ["--user-dir", USER_DIR, "--tokens-per-sample", "16", "--batch-size", "4", "--batches-per-epoch", str(EPOCH),
          "--save-interval-updates", str(SAVE_EVERY), "--max-update", str(MAX_UPDATE), "--optimizer", "adam",
          "--lr", "1e-3", "--seed", "1", "--cpu", "--disable-validation", "--log-format", "json", "--log-interval", "1"]
TASKS = {
    "lm": ["--task", "streaming_lm", "--arch", "ts_lm_tiny", "--sample-break-mode", "none", "--decoder-embed-dim", "16",
           "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2", "--share-decoder-input-output-embed"],
    "mlm": ["--task", "streaming_mlm", "--arch", "ts_mlm_tiny", "--criterion", "masked_lm"],
}
CASES = {  # task, --num-workers, data-parallel ranks (streaming_lm at 2 workers, 1 rank: test_stream_cli.py)
    "lm-workers0": ("lm", 0, 1), "mlm-workers2": ("mlm", 2, 1),
    "lm-dp2-workers2": ("lm", 2, 2), "mlm-dp2-workers0": ("mlm", 0, 2),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two weighted corpora (one split by shard, one by document at 4 readers) and a SentencePiece model."""
    root = make_stream_data(tmp_path_factory.mktemp("stream"), {"a": (4, 5, 2.0), "b": (1, 9, 1.0)})
    train_spm.main([str(root), "--vocab-size", "60"])
    return root


def launch(data: Path, save: Path, task: str, workers: int, world: int, stall_after: int | None = None,
           extra: tuple[str, ...] = ()) -> list[prewarmed.PrewarmedProcess]:
    """``fairseq-train`` on ``world`` gloo ranks (one process each); with ``stall_after`` each
    rank stops making progress after that update (so it can be killed at a known point).
    Rank 0's output is a pipe, the others' go to ``SAVE.rankR.log``."""
    head = [sys.executable, str(STALL_CLI), str(stall_after)] if stall_after is not None else [tool("fairseq-train")]
    cmd = [*head, str(data), *TASKS[task], *COMMON, "--num-workers", str(workers), "--save-dir", str(save), *extra]
    if world > 1:
        cmd += ["--distributed-world-size", str(world), "--distributed-init-method", rendezvous_url(save.parent),
                "--distributed-no-spawn", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]
    procs = [prewarmed.popen([*cmd, *(["--distributed-rank", "0"] if world > 1 else [])], subprocess.PIPE,
                             env=cli_env(), text=True)]
    for r in range(1, world):
        with open(save.parent / f"{save.name}.rank{r}.log", "a") as log:
            procs.append(prewarmed.popen([*cmd, "--distributed-rank", str(r)], log, env=cli_env()))
    return procs


def finish(procs: list[prewarmed.PrewarmedProcess]) -> str:
    """Rank 0's output once every rank exited 0 (every rank is killed if one fails or hangs)."""
    try:
        out = procs[0].communicate(timeout=600)[0]
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert codes == [0] * len(procs), f"exit codes {codes}:\n{out[-4000:]}"
    return out


def kill_after_save(procs: list[prewarmed.PrewarmedProcess], checkpoint: str) -> str:
    """SIGKILL every rank once rank 0 logged writing ``checkpoint``; rank 0's output until then."""
    watchdog = threading.Timer(600, lambda: [p.kill() for p in procs])  # a hang fails this test, not the suite
    watchdog.start()
    lines = []
    try:
        for line in procs[0].stdout:
            lines.append(line)
            if "Saved checkpoint" in line and checkpoint in line:
                break
    finally:
        watchdog.cancel()
        for p in procs:
            p.kill()
            p.wait()
    out = "".join(lines)
    assert lines and checkpoint in lines[-1], f"the run did not save {checkpoint}:\n{out[-4000:]}"
    assert all(p.returncode == -9 for p in procs), f"a rank ended before it was killed:\n{out[-4000:]}"
    return out


def losses(log: str) -> dict[int, str]:
    return {int(r["num_updates"]): r["loss"] for r in json_logs(log, "train_inner")}


def assert_same_parameters(a: Path, b: Path) -> None:
    ref, got = (torch.load(p, weights_only=True)["model"] for p in (a, b))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sigkill_after_mid_epoch_checkpoint_resumes_bitwise(data: Path, tmp_path: Path, case: str) -> None:
    task, workers, world = CASES[case]
    with ThreadPoolExecutor(max_workers=2) as pool:  # the uninterrupted run alongside the killed one
        reference = pool.submit(lambda: finish(launch(data, tmp_path / "ref", task, workers, world)))
        killed = kill_after_save(launch(data, tmp_path / "run", task, workers, world, stall_after=SAVE_EVERY),
                                 f"checkpoint_1_{SAVE_EVERY}.pt")
        position = torch.load(tmp_path / "run" / f"checkpoint_1_{SAVE_EVERY}.pt",
                              weights_only=True)["extra_state"]["train_iterator"]
        resumed = pool.submit(lambda: finish(launch(data, tmp_path / "run", task, workers, world)))
        ref = losses(reference.result())
        if case == "lm-workers0":  # and, beside the restart, from the epoch-end checkpoint (update 4) of the reference
            from_epoch_end = finish(launch(data, tmp_path / "from-epoch-end", task, workers, world,
                                           extra=("--restore-file", str(tmp_path / "ref" / "checkpoint1.pt"))))
        out = resumed.result()
    assert sorted(ref) == list(range(1, MAX_UPDATE + 1))
    assert losses(killed) == {u: ref[u] for u in range(1, SAVE_EVERY + 1)}
    assert (position["epoch"], position["iterations_in_epoch"]) == (1, SAVE_EVERY)
    assert position["stream"]["behind"] == 0  # every rank's position at the checkpoint itself
    assert "data stream resumes after batch 3 of epoch 1 (4 per epoch), reading no batch again" in out
    assert losses(out) == {u: ref[u] for u in range(SAVE_EVERY + 1, MAX_UPDATE + 1)}
    assert_same_parameters(tmp_path / "ref" / "checkpoint_last.pt", tmp_path / "run" / "checkpoint_last.pt")
    if case == "lm-workers0":
        assert losses(from_epoch_end) == {u: ref[u] for u in range(EPOCH + 1, MAX_UPDATE + 1)}
        assert_same_parameters(tmp_path / "ref" / "checkpoint_last.pt",
                               tmp_path / "from-epoch-end" / "checkpoint_last.pt")


# edge cases of the saved position, on the iterator itself (no fairseq-train) -----------------


def test_mid_epoch_state_of_one_process_holds_the_position_itself(tmp_path: Path, task_factory) -> None:
    make_stream_data(tmp_path, {"a": (2, 5, 2.0), "b": (1, 6, 1.0)})
    full, _ = batches(task_factory(tmp_path), 8, 2)
    head, state = batches(task_factory(tmp_path), 5, 2)
    assert (state["epoch"], state["iterations_in_epoch"], state["stream"]["behind"]) == (2, 2, 0)
    tail, _ = batches(task_factory(tmp_path), 3, 2, state=state)
    assert all(torch.equal(a["target"], b["target"]) for a, b in zip(full, head + tail, strict=True))


def test_batches_per_epoch_changed_mid_epoch_is_refused(tmp_path: Path, task_factory) -> None:
    make_stream_data(tmp_path, {"a": (2, 5, 2.0)})
    _, state = batches(task_factory(tmp_path), 4)  # batch 1 of epoch 2, 3 per epoch
    with pytest.raises(TsConfigError, match=r"saved after batch 1 of an epoch of 3 batches, this run has "
                                            r"--batches-per-epoch 2; resume with --batches-per-epoch 3 "):
        batches(task_factory(tmp_path), 1, state=state, epoch_len=2)


def test_batches_per_epoch_may_change_at_an_epoch_end(tmp_path: Path, task_factory) -> None:
    """The stream goes on with the next unseen batch; the epochs after the checkpoint have the new length."""
    make_stream_data(tmp_path, {"a": (2, 5, 2.0)})
    full, _ = batches(task_factory(tmp_path), 7)
    head, state = batches(task_factory(tmp_path), 3)
    assert (state["epoch"], state["iterations_in_epoch"]) == (2, 0)
    tail, after = batches(task_factory(tmp_path), 4, state=state, epoch_len=2)
    assert all(torch.equal(a["target"], b["target"]) for a, b in zip(full, head + tail, strict=True))
    assert (after["epoch"], after["iterations_in_epoch"]) == (4, 0)  # epochs 2 and 3 of 2 batches each


def test_version_3_state_reads_the_batches_since_its_snapshot_again(tmp_path: Path, task_factory, caplog) -> None:
    """A checkpoint written before version 4 holds the positions at the last epoch end and the
    batches handed out since (``behind``): still exact, those batches are read again."""
    make_stream_data(tmp_path, {"a": (2, 5, 2.0), "b": (1, 6, 1.0)})
    full, _ = batches(task_factory(tmp_path), 8)
    _, state = batches(task_factory(tmp_path), 3)  # the snapshot of the epoch end
    state["stream"].pop("batches_per_epoch")
    state["stream"]["behind"] = 2
    state.update(version=3, epoch=2, iterations_in_epoch=2)  # as saved after batch 5
    with caplog.at_level(logging.INFO):
        tail, _ = batches(task_factory(tmp_path), 3, state=state)
    assert all(torch.equal(a["target"], b["target"]) for a, b in zip(full[5:], tail, strict=True))
    assert "resumes after batch 2 of epoch 2 (3 per epoch), reading 2 batch(es) again" in caplog.text


def test_state_without_stream_position_restarts_the_stream(tmp_path: Path, task_factory, caplog) -> None:
    """A checkpoint of another task (no ``stream``) keeps its epoch and offset; the stream starts over."""
    make_stream_data(tmp_path, {"a": (2, 5, 2.0)})
    full, _ = batches(task_factory(tmp_path), 1)
    with caplog.at_level(logging.WARNING):
        got, state = batches(task_factory(tmp_path), 1, state={"epoch": 2, "iterations_in_epoch": 1})
    assert torch.equal(full[0]["target"], got[0]["target"]) and state["iterations_in_epoch"] == 2
    assert "checkpoint has no stream position: the data stream starts from the beginning" in caplog.text
