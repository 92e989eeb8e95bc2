"""The README's multi-node launch, kept working: its ``torchrun`` line (static rendezvous:
``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``, ``--nproc-per-node``),
read from the README, run as two launchers on this machine (``--nnodes 2``, node ranks 0 and 1,
127.0.0.1, 2 gloo processes each, ``--cpu``), against one process:

- TP = 2 x PP = 2 (``--sequence-parallel``, 2 virtual stages, selective recomputation, as the
  README's recipe): the tensor-parallel pairs inside a node, the two pipeline stages on the
  two nodes, every message between the stages crossing them;
- DP = 2 x TP = 2 with ``--zero-sharding os`` (and ``--sequence-parallel``): a data-parallel
  replica per node, the optimizer state sharded across the nodes.

Each equals one process with the same 4 batches per update (``--update-freq 4``; 2 x 2 under
data parallelism) update for update: loss and ``gnorm`` to 1e-5 relative (the pipeline tests'
tolerance), and the last checkpoint, merged, holds the one-process weights (``rtol`` 1e-4, as
there). Logs are unrounded (:mod:`unrounded_cli` is the launched script).
"""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.mp_helpers import REPO, UNROUNDED, USER_DIR, launch, make_corpora, relative_close, run_jobs, train_records
from torchscale_fairseq.interop.checkpoint_files import load_single_process_state

UPDATES = 2  # update 1: the forward and the gradients (loss, gnorm); update 2: the optimizer step
REL = 1e-5
NODES, PER_NODE = 2, 2
PORT_RETRIES = 2
TRAIN = ["--task", "language_modeling", "--arch", "ts_lm_tiny", "--decoder-layers", "4", "--decoder-embed-dim", "64",
         "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4", "--tokens-per-sample", "32",
         "--batch-size", "4", "--max-update", str(UPDATES), "--optimizer", "adam", "--lr", "1e-3", "--clip-norm", "0.5",
         "--dropout", "0", "--log-format", "json", "--log-interval", "1", "--ddp-backend", "legacy_ddp", "--seed", "3",
         "--disable-validation", "--no-epoch-checkpoints"]
CASES = {  # name: per-rank --update-freq and parallel flags (one process: --update-freq 4)
    "tp2_pp2": (4, ("--model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                    "--virtual-pipeline-stages", "2", "--checkpoint-activations", "selective")),
    "dp2_tp2_zero": (2, ("--model-parallel-size", "2", "--sequence-parallel", "--zero-sharding", "os")),
}
# the README's placeholders -> this machine (``{node}``, ``{port}`` filled per launcher)
ONE_MACHINE = {"--nnodes": str(NODES), "--rdzv-backend": "static", "--nproc-per-node": str(PER_NODE), "--node-rank": "{node}",
               "--master-addr": "127.0.0.1", "--master-port": "{port}"}


def readme_launcher() -> list[str]:
    """The ``torchrun`` flags of the README's multi-node recipe (up to the training script)."""
    text = (REPO / "README.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "--nnodes" in b]
    assert len(blocks) == 1, "the README should hold one multi-node (--nnodes) recipe"
    lines = [line.split("#", 1)[0] for line in blocks[0].replace("\\\n", " ").splitlines()]
    words = shlex.split(next(line for line in lines if "torchrun" in line))
    start, end = words.index("torchrun") + 1, words.index("$(which")
    return [w.replace("_", "-") if w.startswith("--") else w for w in words[start:end]]


def one_machine(launcher: list[str], node: int, port: int) -> list[str]:
    """The README's launcher flags with each value this machine needs; a flag the test does not
    know fails it (the README's command changed: teach the test the new flag)."""
    flags, out = launcher[0::2], []
    assert sorted(flags) == sorted(ONE_MACHINE), f"README launcher flags {flags}, the test knows {list(ONE_MACHINE)}"
    for flag in flags:
        out += [flag, ONE_MACHINE[flag].format(node=node, port=port)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_nodes(name: str, data: Path, root: Path, launcher: list[str]) -> tuple[list, list[Path]]:
    """Two launchers (node ranks 0, 1), each running ``fairseq-train`` on its 2 processes."""
    update_freq, flags = CASES[name]
    port = free_port()  # the README's --master-port (node 0's launcher serves the rendezvous there)
    args = [str(data), *TRAIN, "--update-freq", str(update_freq), *flags, "--save-dir", str(root / name),
            "--user-dir", str(USER_DIR), "--cpu"]
    procs, logs = [], []
    for node in range(NODES):
        log = root / name / f"node{node}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", *one_machine(launcher, node, port),
               "--log-dir", str(root / name / f"torchrun{node}"), str(UNROUNDED),
               "fairseq-train", *args]
        procs.append(launch(cmd, log))
        logs.append(log)
    return procs, logs


def finish(procs: list, timeout: float = 600) -> list[int]:
    """Both launchers' exit codes. Once one fails (or time runs out) the other is stopped: it
    would wait for its peer. SIGTERM first, so each launcher stops its own processes."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Both cases and the one-process reference at once. A case whose port was taken between
    :func:`free_port` and node 0's bind (``EADDRINUSE``) runs again on another."""
    root = tmp_path_factory.mktemp("two_nodes")
    data, _ = make_corpora(root)
    launcher = readme_launcher()
    started = {name: start_two_nodes(name, data, root, launcher) for name in CASES}
    reference, _ = run_jobs({"one": ("fairseq-train", [str(data), *TRAIN, "--update-freq", "4",
                                                       "--save-dir", str(root / "one")], 1)}, root, unrounded=True)
    for name, (procs, logs) in started.items():
        codes = finish(procs)
        for _ in range(PORT_RETRIES):
            if codes == [0, 0] or "EADDRINUSE" not in logs[0].read_text():
                break
            procs, logs = start_two_nodes(name, data, root, launcher)
            codes = finish(procs)
        assert codes == [0, 0], f"{name}: launchers exited {codes}:\n" + "\n".join(
            f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    return {"root": root, "one": reference["one"][0], "logs": {name: logs for name, (_, logs) in started.items()}}


def test_readme_recipe_maps_onto_one_machine():
    """The README's launcher line, read as two nodes of this machine: every flag given a value."""
    flags = one_machine(readme_launcher(), 1, 29500)
    assert dict(zip(flags[0::2], flags[1::2])) == {
        "--nnodes": "2", "--rdzv-backend": "static", "--nproc-per-node": "2", "--node-rank": "1",
        "--master-addr": "127.0.0.1", "--master-port": "29500"}


@pytest.mark.parametrize("name", list(CASES))
def test_two_nodes_train_as_one_process(runs, name):
    records = [r for log in runs["logs"][name] for r in train_records(log)]  # global rank 0 logs, on one node
    reference = train_records(runs["one"])
    assert len(records) == len(reference) == UPDATES
    for update, (a, b) in enumerate(zip(records, reference), start=1):
        for key in ("loss", "gnorm"):
            assert relative_close(float(a[key]), float(b[key]), REL), f"update {update} {key}: {a[key]} vs {b[key]}"
    merged = load_single_process_state(str(runs["root"] / name / "checkpoint_last.pt"))["model"]
    want = load_single_process_state(str(runs["root"] / "one" / "checkpoint_last.pt"))["model"]
    assert list(merged) == list(want)
    for key, value in want.items():
        assert torch.allclose(merged[key], value, rtol=1e-4, atol=1e-5), key
