"""Where the ranks of a multi-process test meet: a file, never a guessed port
(:func:`rendezvous_url`, shared with the benchmarks, which import nothing from ``tests/``);
how they start and how they part. torchrun launches use ``--standalone`` (its agent binds
port 0 and hands the workers its store).
"""

from __future__ import annotations

from typing import Callable

from benchmarks._common import rendezvous_url  # noqa: F401  (the tests import it from here)


def start_ranks(worker: Callable[..., None], args: tuple, nprocs: int, device: str = "cpu") -> None:
    """``mp.spawn``'s contract (``worker(rank, *args)`` in ``nprocs`` processes, joined, a rank's
    error raised here), with CPU ranks forked: they inherit the launcher's imports (torch, and
    fairseq where the launcher came from ``tests/helpers/prewarmed.py``) instead of importing them again,
    seconds per rank. CUDA ranks are spawned: a CUDA context does not survive ``fork``. The
    launcher must not have run torch ops before (a forked OpenMP pool would hang)."""
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=args, nprocs=nprocs, start_method="spawn" if device == "cuda" else "fork")


def leave_process_group() -> None:
    """Where the ranks part: all arrive, the plugin's parallel context is dropped, then the process
    group is destroyed while the interpreter is fully alive. A gloo group that something still
    references is otherwise destroyed during interpreter finalisation, which can abort the rank with
    SIGABRT ("terminate called without an active exception"; upstream: pytorch/pytorch#179291)."""
    import gc

    import torch.distributed as dist

    from torchscale_fairseq.model_parallel.parallel_context import destroy_parallel_context

    dist.barrier()
    destroy_parallel_context()
    gc.collect()
    dist.destroy_process_group()
