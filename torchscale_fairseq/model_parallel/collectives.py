"""The single-tensor collectives under the installed PyTorch's names.

torch >= 2.13 names them ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` and
deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, the only names torch <= 2.12
has. Same arguments, same result: ``out`` holds the ranks' ``inp`` concatenated along
dimension 0 (gather), or its own ``1/n`` slice of their sum (reduce-scatter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``out = cat([inp of rank 0, ..., inp of rank n-1], dim=0)``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``out = (sum over ranks of inp).chunk(n)[rank]``."""
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, inp, group=group)
