"""Autograd communication ops of Megatron-LM (paper section 3, Figure 3), each over the
tensor-parallel ``group`` it is given (``None``: a group of one, where every op is the
identity).

``f`` = :func:`copy_to_tensor_parallel_region` (identity forward, all-reduce backward)
and ``g`` = :func:`reduce_from_tensor_parallel_region` (all-reduce forward, identity
backward); a gather along the last dimension (split backward); and
:func:`sum_over_group`, the plain all-reduce that autograd functions with their own
backward use (e.g. the sharded LayerNorm's moments).

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) splits the activations
between the tensor-parallel blocks along the sequence (dimension 1 of the batch-first
``(B, T, C)``): the all-gather before a column-parallel layer lives in that layer
(:class:`~torchscale_fairseq.model_parallel.layers.ColumnParallelLinear`), and
:func:`reduce_scatter_to_sequence_parallel_region` (reduce-scatter forward, all-gather
backward) replaces ``g`` after a row-parallel one: the bytes of the two all-reduces they
replace. A stack enters the region with :func:`scatter_to_sequence_parallel_region` and
leaves it with :func:`gather_from_sequence_parallel_region`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchscale_fairseq.model_parallel.collectives import all_gather_into, reduce_scatter_into
from torchscale_fairseq.model_parallel.process_groups import group_rank, group_size


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x.chunk(group_size(group), dim=-1)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``(B, T/n, C)`` concatenated along the sequence: ``(B, T, C)`` (outside
    autograd)."""
    local = x.transpose(0, 1).contiguous()
    out = local.new_empty((local.size(0) * group_size(group), *local.shape[1:]))
    all_gather_into(out, local, group)
    return out.transpose(0, 1)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, T, C)`` summed over the ranks, each keeping its ``(B, T/n, C)`` slice (outside
    autograd)."""
    full = x.transpose(0, 1).contiguous()
    out = full.new_empty((full.size(0) // group_size(group), *full.shape[1:]))
    reduce_scatter_into(out, full, group)
    return out.transpose(0, 1)


def _split_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x.chunk(group_size(group), dim=1)[group_rank(group)].contiguous()


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_sequence(grad, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


def _tp(fn, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else fn.apply(x, group)


def copy_to_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward."""
    return _tp(_CopyToTensorParallelRegion, x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``g``: all-reduce forward, identity backward."""
    return _tp(_ReduceFromTensorParallelRegion, x, group)


def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` summed over ``group`` into a new tensor, outside autograd (``x`` itself when the
    group has one rank)."""
    return x if group_size(group) == 1 else _all_reduce(x.clone(), group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dimension; split the gradient."""
    return _tp(_GatherFromTensorParallelRegion, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's slice of the sequence (``T`` divisible by the group size); the gradient
    is all-gathered."""
    return _tp(_ScatterToSequenceParallelRegion, x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All ranks' sequence slices concatenated; backward, this rank's slice of a gradient
    every rank holds in full."""
    return _tp(_GatherFromSequenceParallelRegion, x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ranks' partial sums added, each rank keeping its sequence slice; the gradient
    is all-gathered."""
    return _tp(_ReduceScatterToSequenceParallelRegion, x, group)
