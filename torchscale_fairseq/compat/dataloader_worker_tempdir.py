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
a worker inherits it (``BaseProcess._config``, under every start method) and puts its sockets there,
and the starting process, which exits normally, removes the directory with whatever is left in it.

Also refused in one line: a ``$TMPDIR`` so long that a worker's socket path exceeds what a Unix
socket address holds (107 bytes on Linux, 103 elsewhere). The worker's bind then fails in its
queue's feeder thread ("OSError: AF_UNIX path too long", e.g. hzi-bifo/RiboDetector issue 57), no
batch ever arrives, and the trainer waits forever. (Pythons with CPython gh-132124 fall back to
``/tmp`` themselves and name the sockets differently: the check reads both from multiprocessing.)
"""

from __future__ import annotations

import multiprocessing.connection
import multiprocessing.util
import os
import sys

import torch.multiprocessing
from torch.utils.data import dataloader

from torchscale_fairseq.errors import TsConfigError

SOCKET_PATH_BYTES = 107 if sys.platform.startswith("linux") else 103  # sizeof(sun_path) - 1

_stock_get_iterator = dataloader.DataLoader._get_iterator


def worker_socket_path(directory: str) -> str:
    """A path of the form multiprocessing gives a worker's socket in ``directory``."""
    return os.path.join(directory, os.path.basename(multiprocessing.connection.arbitrary_address("AF_UNIX")))


def check_worker_socket_path(directory: str) -> None:
    """Raise :class:`TsConfigError` if a worker's socket in ``directory`` (``$TMPDIR/pymp-*``) would not bind."""
    path = os.fsencode(worker_socket_path(directory))
    if len(path) > SOCKET_PATH_BYTES:
        tmpdir = os.path.dirname(directory)
        room = SOCKET_PATH_BYTES - (len(path) - len(os.fsencode(tmpdir)))
        raise TsConfigError(
            f"the data loader's workers would put their sockets in the temporary directory {tmpdir}, whose socket "
            f"paths take {len(path)} bytes, over the {SOCKET_PATH_BYTES} of a Unix socket address (the run would wait "
            f"forever for its first batch): set TMPDIR to a directory of at most {room} bytes, or use --num-workers 0")


def get_iterator(loader: dataloader.DataLoader) -> dataloader._BaseDataLoaderIter:
    """``DataLoader._get_iterator``, the multiprocessing temporary directory created (and checked) first
    where the loader starts workers."""
    if loader.num_workers > 0:
        directory = multiprocessing.util.get_temp_dir()
        if torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
            check_worker_socket_path(directory)
    return _stock_get_iterator(loader)


def patch_dataloader_worker_tempdir() -> None:
    dataloader.DataLoader._get_iterator = get_iterator
