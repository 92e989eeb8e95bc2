"""A recorder of collectives, for ``tp_bytes.py`` and the tests that count collectives: wraps
``torch.distributed.all_reduce``, ``all_gather``, ``all_to_all_single`` and the sequence-parallel ``all_gather_single`` /
``reduce_scatter_single`` (``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on torch <= 2.12,
recorded under the new names) while active and records ``(collective, direction, numel)`` for
each call, ``direction`` being ``backward`` inside an autograd backward pass (which
includes what activation checkpointing recomputes there); ``numel`` counts the input. With
``point_to_point``, ``batch_isend_irecv`` is recorded too: one ``("send", direction, numel)`` per send it posts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

# attribute of torch.distributed -> the name it is recorded under
RECORDED = {name: name for name in ("all_reduce", "all_gather", "all_to_all_single", "all_gather_single",
                                    "reduce_scatter_single")}
RECORDED.update(all_gather_into_tensor="all_gather_single", reduce_scatter_tensor="reduce_scatter_single")


@contextlib.contextmanager
def record_collectives(point_to_point: bool = False) -> Iterator[list[tuple[str, str, int]]]:
    log: list[tuple[str, str, int]] = []
    originals = {name: getattr(dist, name) for name in RECORDED if hasattr(dist, name)}
    if point_to_point:
        originals["batch_isend_irecv"] = dist.batch_isend_irecv

    def recorder(name: str):
        def call(first, *args, **kwargs):
            direction = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            if name == "batch_isend_irecv":
                log.extend(("send", direction, op.tensor.numel()) for op in first if op.op is dist.isend)
            else:
                log.append((RECORDED[name], direction, (first if name == "all_reduce" else args[0]).numel()))
            return originals[name](first, *args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, recorder(name))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
