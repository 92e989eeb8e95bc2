"""DataLoader workers' multiprocessing directories (``compat/dataloader_worker_tempdir.py``): a
process that stops reading a multi-process DataLoader leaves no ``pymp-*`` directory in its
``$TMPDIR`` (PyTorch's own iterator leaves one per run, which the control below shows), the
batches are those of a single-process DataLoader, and ``fairseq-train`` stopping inside an epoch,
one process and two ranks, leaves none. A ``$TMPDIR`` too long for the workers' sockets is one line,
and the longest one allowed trains (the operating system binds the sockets: the independent check
of the limit)."""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, cli_env, last_error_line, run, tool
from torchscale_fairseq.compat.dataloader_worker_tempdir import SOCKET_PATH_BYTES

STOPPED_READER = r"""
import json, sys
import torch
from torch.utils.data import DataLoader

stock = DataLoader._get_iterator
import torchscale_fairseq  # noqa: F401  (installs the fix)
if sys.argv[1] == "stock":
    DataLoader._get_iterator = stock

def loader(workers):
    return DataLoader(list(range(64)), batch_size=4, num_workers=workers, collate_fn=lambda b: torch.tensor(b) ** 2)

read = iter(loader(2))
got = [next(read).tolist() for _ in range(3)]
want = [b.tolist() for b in list(loader(0))[:3]]
print(json.dumps({"same": got == want, "iterator": DataLoader._get_iterator.__module__}), flush=True)
"""


# what multiprocessing adds to $TMPDIR for a worker's socket: "/pymp-" and 8 characters, then the socket's name
WORKER_SOCKET_SUFFIX_BYTES = len("/pymp-12345678/") + len(os.path.basename(multiprocessing.connection.arbitrary_address(
    "AF_UNIX")))


def socket_path_limit(directory: str) -> int:
    """The longest path a Unix socket binds at, found by binding sockets (the operating system's limit)."""
    for length in range(120, 80, -1):
        path = os.path.join(directory, "s" * (length - len(directory) - 1))
        with socket.socket(socket.AF_UNIX) as sock:
            try:
                sock.bind(path)
            except OSError:
                continue
            os.unlink(path)
            return length
    raise AssertionError("no Unix socket path of 81-120 bytes binds")


@pytest.fixture
def longest_tmpdir() -> Iterator[str]:
    """A directory whose path is as long as ``$TMPDIR`` may be for the workers' sockets to bind (75 bytes on
    Linux), under ``/tmp`` (the suite's own temporary directory may be longer)."""
    base = tempfile.mkdtemp(prefix="ts-", dir="/tmp")
    try:
        longest = socket_path_limit(base) - WORKER_SOCKET_SUFFIX_BYTES
        assert longest == SOCKET_PATH_BYTES - WORKER_SOCKET_SUFFIX_BYTES  # the check's limit is the system's
        path = os.path.join(base, "d" * (longest - len(base) - 1))
        os.mkdir(path)
        yield path
    finally:
        shutil.rmtree(base)


def _leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("pymp-"))


@pytest.mark.parametrize("iterator", ["fixed", "stock"])
def test_a_reader_that_stops_early_leaves_no_directory(longest_tmpdir: str, iterator: str) -> None:
    tmp = Path(longest_tmpdir)
    proc = subprocess.run([sys.executable, "-c", STOPPED_READER, iterator], capture_output=True, text=True,
                          env=cli_env({"TMPDIR": longest_tmpdir}), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"]
    if iterator == "fixed":
        assert out["iterator"] == "torchscale_fairseq.compat.dataloader_worker_tempdir"
        assert _leftovers(tmp) == []
    else:  # the upstream bug this fix exists for, on the installed torch
        assert len(_leftovers(tmp)) == 2, _leftovers(tmp)


@pytest.mark.parametrize("ranks", [1, 2])
def test_fairseq_train_stopping_inside_an_epoch_leaves_no_directory(lm_data: Path, tmp_path: Path,
                                                                     longest_tmpdir: str, ranks: int) -> None:
    """Also: the workers' sockets bind at the longest ``$TMPDIR`` the check lets through (a limit one byte
    too long would leave the run waiting for its first batch, here until the timeout)."""
    launcher = [tool("torchrun"), "--nproc_per_node", "2", "--standalone",
                "--log-dir", tmp_path / "torchrun"] if ranks == 2 else []
    distributed = ["--distributed-backend", "gloo"] if ranks == 2 else []
    run([*launcher, tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--save-dir", tmp_path / "save",
         *LM_TRAIN, "--arch", "ts_lm_tiny", "--max-update", "3", "--no-save", "--disable-validation",
         "--num-workers", "1", *distributed], env={"TMPDIR": longest_tmpdir}, timeout=240)
    assert _leftovers(Path(longest_tmpdir)) == []


def test_a_tmpdir_too_long_for_the_workers_sockets_is_one_line(lm_data: Path, tmp_path: Path,
                                                              longest_tmpdir: str) -> None:
    """One byte more than the longest ``$TMPDIR``: one line naming it and the limit, instead of a run that
    waits forever (the workers' sockets would not bind), and nothing left in it. A Python that moves such
    sockets to ``/tmp`` by itself (CPython gh-132124) trains instead, and leaves nothing there either."""
    too_long = longest_tmpdir + "d"
    os.mkdir(too_long)
    where = subprocess.run([sys.executable, "-c", "import multiprocessing.util as u; print(u.get_temp_dir())"],
                           capture_output=True, text=True, env=cli_env({"TMPDIR": too_long}), check=True).stdout
    proc = run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--save-dir", tmp_path, *LM_TRAIN,
                "--arch", "ts_lm_tiny", "--max-update", "3", "--no-save", "--num-workers", "1"],
               env={"TMPDIR": too_long}, check=False, timeout=240)
    if not where.startswith(too_long + os.sep):
        assert proc.returncode == 0 and _leftovers(Path(too_long)) == [], proc.stderr[-2000:]
        return
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert last_error_line(proc) == (
        f"fairseq-train: error: the data loader's workers would put their sockets in the temporary directory {too_long}, "
        f"whose socket paths take {SOCKET_PATH_BYTES + 1} bytes, over the {SOCKET_PATH_BYTES} of a Unix socket address "
        f"(the run would wait forever for its first batch): set TMPDIR to a directory of at most "
        f"{len(longest_tmpdir)} bytes, or use --num-workers 0")
    assert _leftovers(Path(too_long)) == []  # the one-line exit removes the directory the refusal made
