"""The global gradient norm with every gradient counted exactly once.

- tensor-parallel shards (parameters with ``tensor_parallel_dim``) are summed over the
  tensor-parallel group; replicated parameters (LayerNorms, row-parallel biases) are
  identical on every tensor-parallel rank and counted once;
- expert parameters (``param.expert`` true) are summed over ``param.expert_group``, the
  ranks that hold *different* experts (``None``: all experts are local);
- the expert part may be down-weighted by ``kappa`` (SparseClip: ``1/sqrt(E)``):
  ``||g|| = ||(g_d, kappa * g_s)||_2``.

Unlike ``fairseq.utils.clip_grad_norm_`` (which leaves expert gradients out of the norm
and, with model parallelism, adds replicated parameters once per rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from torchscale_fairseq.model_parallel.partition import sharded_dim
from torchscale_fairseq.model_parallel.process_groups import (
    get_tensor_parallel_group,
    get_tensor_parallel_world_size,
)


def is_expert(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert", False))


@dataclass
class GradNorm:
    dense: torch.Tensor
    expert: torch.Tensor
    total: torch.Tensor


def _sq(grads) -> torch.Tensor:
    """Sum of squared entries of ``grads`` in fp32: one ``_foreach_norm`` pass, no
    squared or fp32 copies of the gradients."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if dist.is_initialized() and (group is None or dist.get_world_size(group) > 1):
        t = t.clone()
        dist.all_reduce(t, group=group)
    return t


def squared_norm_parts(params: Iterable[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(||g_d||^2, ||g_s||^2)`` over the whole model, every gradient counted once."""
    sharded, replicated = [], []
    experts: Dict[Optional[object], list] = {}
    for p in params:
        if p is None or p.grad is None:
            continue
        if is_expert(p):
            experts.setdefault(getattr(p, "expert_group", None), []).append(p.grad)
        elif sharded_dim(p) is not None:
            sharded.append(p.grad)
        else:
            replicated.append(p.grad)
    dense_sharded = _sq(sharded)
    if get_tensor_parallel_world_size() > 1:
        dense_sharded = _all_reduce(dense_sharded, get_tensor_parallel_group())
    dense = dense_sharded + _sq(replicated)
    expert = torch.zeros((), dtype=torch.float32)
    for group, grads in experts.items():
        part = _sq(grads)
        if group is not None:
            part = _all_reduce(part, group)
        expert = expert + part
    return dense, expert


def grad_norm(params: Iterable[torch.Tensor], kappa: float = 1.0) -> GradNorm:
    """``||(g_d, kappa g_s)||_2`` with its dense and expert parts."""
    dense_sq, expert_sq = squared_norm_parts(params)
    return GradNorm(dense_sq.sqrt(), expert_sq.sqrt(), (dense_sq + kappa**2 * expert_sq).sqrt())


def clip_grads_(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> bool:
    """``g <- xi / max(xi, ||g||) * g`` for every gradient; True when clipping fired."""
    if max_norm <= 0 or not torch.isfinite(total_norm) or total_norm <= max_norm:
        return False
    coef = max_norm / (float(total_norm) + 1e-6)
    grads = [p.grad.detach() for p in params if p is not None and p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef)
    return True
