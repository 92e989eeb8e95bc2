"""Autograd communication ops of Megatron-LM (paper section 3, Figure 3).

``f`` = :func:`copy_to_tensor_parallel_region` (identity forward, all-reduce backward)
and ``g`` = :func:`reduce_from_tensor_parallel_region` (all-reduce forward, identity
backward); plus scatter/gather along the last dimension and a sum all-reduce whose
backward is also an all-reduce (for statistics every rank consumes, e.g. sharded
LayerNorm moments). All are identities at tensor-parallel size 1.

Every collective is recorded in :data:`COLLECTIVES` while :func:`record_collectives`
is active, so tests can count them and their sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from torchscale_fairseq.model_parallel.process_groups import (
    get_tensor_parallel_group,
    get_tensor_parallel_rank,
    get_tensor_parallel_world_size,
)

COLLECTIVES: list[tuple[str, str, int]] | None = None


@contextlib.contextmanager
def record_collectives() -> Iterator[list[tuple[str, str, int]]]:
    """Record ``(op, direction, numel)`` of every tensor-parallel collective."""
    global COLLECTIVES
    previous, COLLECTIVES = COLLECTIVES, []
    try:
        yield COLLECTIVES
    finally:
        COLLECTIVES = previous


def log_collective(op: str, direction: str, tensor: torch.Tensor) -> None:
    """Record one collective (no-op unless :func:`record_collectives` is active)."""
    if COLLECTIVES is not None:
        COLLECTIVES.append((op, direction, tensor.numel()))


def _all_reduce(x: torch.Tensor, op: str, direction: str) -> torch.Tensor:
    if get_tensor_parallel_world_size() == 1:
        return x
    x = x.contiguous()
    log_collective(op, direction, x)
    dist.all_reduce(x, group=get_tensor_parallel_group())
    return x


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    n = get_tensor_parallel_world_size()
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[get_tensor_parallel_rank()].contiguous()


def _gather_last_dim(x: torch.Tensor, op: str, direction: str) -> torch.Tensor:
    n = get_tensor_parallel_world_size()
    if n == 1:
        return x
    x = x.contiguous()
    log_collective(op, direction, x)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=get_tensor_parallel_group())
    return torch.cat(parts, dim=-1)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), "f", "backward")


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone(), "g", "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone(), "stats", "forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), "stats", "backward")


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, "gather", "backward")


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last_dim(x, "gather", "forward")

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


def _tp(fn, x: torch.Tensor) -> torch.Tensor:
    return x if get_tensor_parallel_world_size() == 1 else fn.apply(x)


def copy_to_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward."""
    return _tp(_CopyToTensorParallelRegion, x)


def reduce_from_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """``g``: all-reduce forward, identity backward."""
    return _tp(_ReduceFromTensorParallelRegion, x)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group that every rank consumes: all-reduce both ways."""
    return _tp(_AllReduceSum, x)


def scatter_to_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; gather the gradient."""
    return _tp(_ScatterToTensorParallelRegion, x)


def gather_from_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's slice along the last dimension; split the gradient."""
    return _tp(_GatherFromTensorParallelRegion, x)
