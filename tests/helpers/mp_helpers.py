"""Helpers of the tensor-parallel tests: one subprocess per rank (gloo on CPU, the flags a
user passes, a ``file://`` rendezvous), tiny corpora, parsing fairseq logs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.helpers import prewarmed
from tests.helpers.rendezvous import rendezvous_url

REPO = Path(__file__).resolve().parents[2]
USER_DIR = REPO / "torchscale_fairseq"
BIN = Path(sys.executable).parent
UNROUNDED = REPO / "tests" / "workers" / "unrounded_cli.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
# a CPU rank on a GPU machine would still open a CUDA context (~500 MB of GPU memory each; the
# suite's ~160 ranks run the GPU out of memory): CPU ranks see no GPU
CPU_ENV = {**ENV, "CUDA_VISIBLE_DEVICES": ""}


def dist_flags(world: int, rank: int, init_method: str) -> list[str]:
    """fairseq's flags for rank ``rank`` of ``world`` meeting at ``init_method``
    (:func:`~tests.helpers.rendezvous.rendezvous_url`)."""
    if world == 1:
        return []
    return [
        "--distributed-world-size", str(world), "--distributed-rank", str(rank),
        "--distributed-init-method", init_method, "--distributed-no-spawn",
        "--distributed-backend", "gloo",
    ]


def launch(cmd: Sequence[str], log: Path, cpu: bool = True) -> subprocess.Popen | prewarmed.PrewarmedProcess:
    """Start ``cmd`` (a Python program: from the prewarmed server) with its output in ``log``;
    ``cpu``: without the GPUs."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        return prewarmed.popen(cmd, out, env=CPU_ENV if cpu else ENV, cwd=REPO)


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 300) -> None:
    for p, log in zip(procs, logs):
        code = p.wait(timeout=timeout)
        if code != 0:
            raise AssertionError(f"{' '.join(p.args[:3])} ... exited {code}:\n" + log.read_text()[-3000:])


def run_worker_ranks(worker: Path, world: int, out: Path, *extra: str, timeout: float = 180) -> dict:
    """Run ``python WORKER RANK WORLD INIT_METHOD OUT.json [EXTRA...]`` on ``world`` gloo
    ranks (NCCL with ``cuda`` in ``extra``; logs in ``out``); return the JSON rank 0 wrote."""
    init_method = rendezvous_url(out)
    result = out / "results.json"
    logs = [out / f"rank{r}.log" for r in range(world)]
    procs = [launch([sys.executable, str(worker), str(r), str(world), init_method, str(result), *extra], logs[r],
                    cpu="cuda" not in extra)
             for r in range(world)]
    wait_all(procs, logs, timeout=timeout)
    return json.loads(result.read_text())


def fairseq_ranks(tool: str, args: Sequence[str], world: int, out: Path,
                  unrounded: bool = False) -> tuple[list[subprocess.Popen], list[Path]]:
    """Start ``world`` processes of the fairseq console tool ``tool`` (one rendezvous);
    return them and their logs. A training without ``--save-dir`` saves under ``out`` (fairseq
    creates the save directory even with ``--no-save``; the default ``./checkpoints`` is the repository's)."""
    init_method = rendezvous_url(out)
    if tool == "fairseq-train" and not any(a == "--save-dir" or str(a).startswith("--save-dir=") for a in args):
        args = [*args, "--save-dir", str(out / "checkpoints")]
    procs, logs = [], []
    for rank in range(world):
        log = out / f"{tool}.{rank}.log"
        cmd = [sys.executable, str(UNROUNDED), tool] if unrounded else [str(BIN / tool)]
        procs.append(launch([*cmd, *args, "--user-dir", str(USER_DIR), "--cpu", *dist_flags(world, rank, init_method)], log))
        logs.append(log)
    return procs, logs


def run_fairseq(tool: str, args: Sequence[str], world: int, out: Path, unrounded: bool = False) -> list[Path]:
    procs, logs = fairseq_ranks(tool, args, world, out, unrounded)
    wait_all(procs, logs)
    return logs


PROCESS_BYTES = 800 * 2**20  # a tiny fairseq run's resident memory (~470 MB) with a margin


def process_slots() -> int:
    """How many fairseq processes fit in the memory available now (at least 4)."""
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    return max(4, available // PROCESS_BYTES)


def run_jobs(jobs: dict[str, tuple[str, Sequence[str], int]], root: Path, unrounded: bool = False,
             must_fail: Sequence[str] = (), timeout: float = 600) -> tuple[dict[str, list[Path]], dict[str, int]]:
    """Run every job ``name: (tool, args, world)`` as ``world`` ranks (logs in ``root/name``),
    as many at once as :func:`process_slots` allows: a job starts whole (its ranks meet at one
    rendezvous), in the given order, when its ranks fit beside the running ones (or nothing
    runs). Every job must exit 0, except those in ``must_fail``, whose rank 0 must not; returns
    the logs and rank 0's exit code of each job. Raises with the failing rank's log."""
    slots, pending, running = process_slots(), list(jobs), {}
    logs, codes, deadline = {}, {}, {}
    while pending or running:
        while pending and (not running or sum(len(p) for p, _ in running.values()) + jobs[pending[0]][2] <= slots):
            name = pending.pop(0)
            tool, args, world = jobs[name]
            running[name] = fairseq_ranks(tool, args, world, root / name, unrounded)
            logs[name], deadline[name] = running[name][1], time.monotonic() + timeout
        for name, (procs, job_logs) in list(running.items()):
            if time.monotonic() > deadline[name]:
                for p in procs:
                    p.kill()
                raise AssertionError(f"{name} ran past {timeout} s:\n" + job_logs[0].read_text()[-3000:])
            if any(p.poll() is None for p in procs):
                continue
            del running[name]
            codes[name] = procs[0].returncode
            failed = [(p, log) for p, log in zip(procs, job_logs) if p.returncode != 0]
            if name in must_fail:
                assert codes[name] != 0, f"{name} should have failed:\n" + job_logs[0].read_text()[-3000:]
            elif failed:
                for other, _ in running.values():
                    for p in other:
                        p.kill()
                p, log = failed[0]
                raise AssertionError(f"{name}: {' '.join(p.args[:3])} ... exited {p.returncode}:\n"
                                     + log.read_text()[-3000:])
        time.sleep(0.1)
    return logs, codes


def train_records(log: Path) -> list[dict]:
    """The ``train_inner`` JSON records of a ``--log-format json --log-interval 1`` run
    (fairseq's log format or the bare ``INFO:train_inner:{...}`` of :mod:`unrounded_cli`)."""
    records = []
    for line in log.read_text().splitlines():
        if "train_inner" in line and "{" in line:
            records.append(json.loads(line[line.index("{"):]))
    return records


def _binarize(lines: list[str], dictionary, prefix: Path) -> None:
    from fairseq.data import indexed_dataset

    builder = indexed_dataset.make_builder(f"{prefix}.bin", impl="mmap", vocab_size=len(dictionary))
    for line in lines:
        builder.add_item(dictionary.encode_line(line, add_if_not_exist=False))
    builder.finalize(f"{prefix}.idx")


def _dictionary(lines: list[str], path: Path):
    from fairseq.data import Dictionary

    d = Dictionary()
    for line in lines:
        for word in line.split():
            d.add_symbol(word)
    d.save(str(path))
    return d


def make_corpora(root: Path) -> tuple[Path, Path]:
    """A language-modelling and a translation data set, binarised as fairseq-preprocess
    does (in this process: every extra process start costs seconds on a shared CPU)."""
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(300)]

    def sentence(lo: int, hi: int, words: list[str]) -> list[str]:
        return [rng.choice(words) for _ in range(rng.randint(lo, hi))]

    lm = {split: [" ".join(sentence(4, 20, vocab)) for _ in range(n)]
          for split, n in (("train", 600), ("valid", 40), ("test", 40))}
    src = {split: [sentence(3, 12, vocab[:200]) for _ in range(n)] for split, n in (("train", 600), ("valid", 12),
                                                                                     ("test", 12))}
    mt = {split: ([" ".join(s) for s in sents], [" ".join(f"t{w}" for w in reversed(s)) for s in sents])
          for split, sents in src.items()}
    lm_bin, mt_bin = root / "lm_bin", root / "mt_bin"
    lm_bin.mkdir(parents=True)
    mt_bin.mkdir(parents=True)
    lm_dict = _dictionary(lm["train"], lm_bin / "dict.txt")
    src_dict = _dictionary(mt["train"][0], mt_bin / "dict.src.txt")
    tgt_dict = _dictionary(mt["train"][1], mt_bin / "dict.tgt.txt")
    for split, lines in lm.items():
        _binarize(lines, lm_dict, lm_bin / split)
        _binarize(mt[split][0], src_dict, mt_bin / f"{split}.src-tgt.src")
        _binarize(mt[split][1], tgt_dict, mt_bin / f"{split}.src-tgt.tgt")
    return lm_bin, mt_bin


def assert_replicated_across_parts(paths: Sequence[Path]) -> list[str]:
    """The tensor-parallel parts ``paths`` (rank order, one expert shard) of one checkpoint:
    every tensor the parameter-attribute registry does not mark as split (the layout the
    checkpoint records from it) is bitwise equal in all parts, with its Adam moments, and
    every split one differs. Returns the replicated names."""
    import torch

    from torchscale_fairseq.checkpoints.layout import read_record

    parts = [torch.load(path, weights_only=True) for path in paths]
    record = read_record(parts[0])
    assert record.tp_size == len(parts) > 1 and record.tp_layout and record.params, paths[0]
    models = [part["model"] for part in parts]
    assert all(m.keys() == models[0].keys() for m in models)
    replicated = [key for key in models[0] if key not in record.tp_layout]
    for key in models[0]:
        same = all(torch.equal(m[key], models[0][key]) for m in models[1:])
        assert same == (key in replicated), f"{key}: {'split but identical' if same else 'replicated but differs'}"
    moments = [part["last_optimizer_state"]["state"] for part in parts]
    for index, name in enumerate(record.params):
        if name in replicated:
            for kind, value in moments[0][index].items():
                if torch.is_tensor(value):
                    assert all(torch.equal(m[index][kind], value) for m in moments[1:]), (name, kind)
    return replicated


def relative_close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)
