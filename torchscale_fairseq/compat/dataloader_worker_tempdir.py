"""A ``pymp-*`` directory left in ``$TMPDIR`` by every ``fairseq-train`` run that stops inside an
epoch (``--max-update``, ``--stop-time-hours``, an interrupted run), one per rank.

A PyTorch DataLoader worker (``--num-workers``, default 1) hands each batch's storages to the
trainer as file descriptors, through multiprocessing's resource sharer, whose listener socket lives
in a ``pymp-*`` directory the worker creates and removes at its own exit. fairseq keeps the epoch
iterator referenced until the interpreter exits (the task caches it), so the DataLoader iterator is
never shut down: multiprocessing's exit hook terminates the daemonic worker with SIGTERM and the
worker's finalisers, which remove the directory, never run (the symptom of OasisLMF/OasisPlatform
issue 363). Stock fairseq 0.12.2 and fairseq-fixed 0.12.3.1 with torch 2.x, Python 3.10-3.13.

Fix: the process that starts the workers creates its own multiprocessing temporary directory first;
a forked worker inherits it (``BaseProcess._config``) and puts its sockets there, and the starting
process, which exits normally, removes the directory with whatever is left in it.

Also refused in one line: a ``$TMPDIR`` so long that a worker's socket path exceeds what a Unix
socket address holds (107 bytes on Linux, 103 on macOS). The worker's bind then fails in its queue's
feeder thread ("OSError: AF_UNIX path too long", e.g. hzi-bifo/RiboDetector issue 57), no batch ever
arrives, and the trainer waits forever.
"""

from __future__ import annotations

import multiprocessing.util
import os
import sys
import tempfile

import torch.multiprocessing
from torch.utils.data import dataloader

from torchscale_fairseq.errors import TsConfigError

SOCKET_PATH_BYTES = 103 if sys.platform == "darwin" else 107  # sizeof(sun_path) - 1
# a worker's socket in the temporary directory: multiprocessing.util.get_temp_dir's directory and
# multiprocessing.connection.arbitrary_address's name, each with 8 random characters
WORKER_SOCKET = os.path.join("pymp-XXXXXXXX", "listener-XXXXXXXX")


def check_worker_socket_path(tmpdir: str) -> None:
    """Raise :class:`TsConfigError` if a worker's socket under ``tmpdir`` (``$TMPDIR``) would not bind."""
    path = os.fsencode(os.path.join(tmpdir, WORKER_SOCKET))
    if len(path) > SOCKET_PATH_BYTES:
        room = SOCKET_PATH_BYTES - (len(path) - len(os.fsencode(tmpdir)))
        raise TsConfigError(
            f"the data loader's workers would put their sockets in the temporary directory {tmpdir}, whose socket "
            f"paths take {len(path)} bytes, over the {SOCKET_PATH_BYTES} of a Unix socket address (the run would wait "
            f"forever for its first batch): set TMPDIR to a directory of at most {room} bytes, or use --num-workers 0")


class WorkerTempdirDataLoaderIter(dataloader._MultiProcessingDataLoaderIter):
    """PyTorch's multi-process DataLoader iterator, whose workers use the starting process's
    multiprocessing temporary directory."""

    def __init__(self, loader: dataloader.DataLoader) -> None:
        if torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
            check_worker_socket_path(tempfile.gettempdir())
        multiprocessing.util.get_temp_dir()
        super().__init__(loader)


def patch_dataloader_worker_tempdir() -> None:
    dataloader._MultiProcessingDataLoaderIter = WorkerTempdirDataLoaderIter
