"""How a full tensor is cut into tensor-parallel shards and put back together.

A sharded parameter carries two attributes: ``tensor_parallel_dim`` (the dimension
that is split) and ``tensor_parallel_stride`` (how many independent blocks the full
tensor stacks along that dimension, e.g. 3 for a fused Q/K/V weight). Each block is
cut into N equal chunks and rank r keeps chunk r of every block, so heads stay whole.
Parameters without the attributes are replicated on every tensor-parallel rank.
"""

from __future__ import annotations

from torchscale_fairseq.errors import TsConfigError

from typing import List, Optional

import torch

TP_DIM = "tensor_parallel_dim"
TP_STRIDE = "tensor_parallel_stride"


def mark_sharded(param: torch.Tensor, dim: int, stride: int = 1) -> torch.Tensor:
    setattr(param, TP_DIM, dim)
    setattr(param, TP_STRIDE, stride)
    return param


def sharded_dim(param: torch.Tensor) -> Optional[int]:
    """The split dimension of a sharded parameter, ``None`` for a replicated one."""
    return getattr(param, TP_DIM, None)


def is_replicated(param: torch.Tensor) -> bool:
    return sharded_dim(param) is None


def shard_tensor(full: torch.Tensor, dim: int, stride: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (see the module docstring)."""
    if world_size == 1:
        return full
    blocks = full.chunk(stride, dim=dim)
    size = full.size(dim)
    if size % (stride * world_size) != 0:
        raise TsConfigError(
            f"a dimension of size {size} cannot be split into {stride} blocks x {world_size} "
            "tensor-parallel ranks: choose sizes divisible by --model-parallel-size"
        )
    return torch.cat([b.chunk(world_size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unshard_tensors(shards: List[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` over all ranks' shards, in rank order."""
    if len(shards) == 1:
        return shards[0]
    per_rank_blocks = [s.chunk(stride, dim=dim) for s in shards]
    blocks = [torch.cat([blocks[i] for blocks in per_rank_blocks], dim=dim) for i in range(stride)]
    return torch.cat(blocks, dim=dim)
