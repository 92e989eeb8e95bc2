"""The global gradient norm with every gradient counted exactly once.

- tensor-parallel shards (parameters with ``tensor_parallel_dim``) are summed over the
  tensor-parallel group; replicated parameters (LayerNorms, row-parallel biases) are
  identical on every tensor-parallel rank and counted once;
- expert parameters are summed over their all-to-all group, the ranks that hold *different*
  experts (the context's expert groups of the size the parameter is tagged with; size 1: all
  experts local; tags in :mod:`torchscale_fairseq.model_parallel.attributes`), and split experts' shards
  (expert parameters with ``tensor_parallel_dim``) also over the tensor-parallel group;
  whole experts are replicated on the tensor-parallel ranks and counted once;
- under pipeline parallelism both parts are summed over the pipeline group (each stage holds
  other layers); the last stage's copy of the tied embedding is left out (its gradient equals
  the first stage's after the embedding all-reduce);
- ``--zero-sharding full``: a gradient sharded over the data-parallel group (a DTensor) counts
  its local shard, summed over the data-parallel group;
- the expert part may be down-weighted by ``kappa`` (SparseClip: ``1/sqrt(E)``):
  ``||g|| = ||(g_d, kappa * g_s)||_2``.

Every group comes from the run's
:class:`~torchscale_fairseq.model_parallel.parallel_context.ParallelContext`, given as an argument.
Unlike ``fairseq.utils.clip_grad_norm_`` (which leaves expert gradients out of the norm
and, with model parallelism, adds replicated parameters once per rank).

fp16's flat fp32 master (one tensor for all parameters) remembers its source parameters
in ``ts_flat_sources``; :func:`flat_master_views` splits its gradient back into
per-parameter views that carry the sources' attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Tuple

import torch
import torch.distributed as dist

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import (
    PARALLEL_ATTRIBUTE_DEFAULTS,
    expert_parallel_size,
    is_expert,
    pipeline_tied_role,
    sharded_dim,
)
from torchscale_fairseq.model_parallel.grads import is_dtensor, local_shard
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.model_parallel.process_groups import group_size

FLAT_MASTER_SOURCES = "ts_flat_sources"


def flat_master_views(params: Iterable[Any]) -> Iterator[Any]:
    """``params``, with a flat fp32 master split into per-source-parameter views."""
    for p in params:
        sources = getattr(p, FLAT_MASTER_SOURCES, None)
        if sources is None or p.grad is None:
            yield p
            continue
        flat, offset = p.grad.view(-1), 0
        for src in sources:
            n = src.numel()
            attrs = {a: getattr(src, a) for a in PARALLEL_ATTRIBUTE_DEFAULTS if hasattr(src, a)}
            yield SimpleNamespace(grad=flat[offset : offset + n], **attrs)
            offset += n


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


def squared_norm_parts(params: Iterable[torch.Tensor], parallel: ParallelContext) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(||g_d||^2, ||g_s||^2)`` over the whole model, every gradient counted once
    (shards of ``tensor_parallel_dim`` parameters summed over ``parallel``'s tensor-parallel group,
    experts over their all-to-all group, stages over the pipeline group)."""
    tp_group, pipeline_group = parallel.tensor_group, parallel.pipeline_group
    sharded, replicated = [], []
    dp_sharded: tuple[list, list] = ([], [])  # (tensor-parallel shards, replicated) sharded over data parallelism
    experts: dict[tuple[int, bool], list] = {}
    for p in params:
        if p is None or p.grad is None or pipeline_tied_role(p) == "copy":
            continue
        if is_expert(p):
            experts.setdefault((expert_parallel_size(p), sharded_dim(p) is not None), []).append(p.grad)
        elif is_dtensor(p.grad):
            dp_sharded[sharded_dim(p) is None].append(local_shard(p.grad))
        elif sharded_dim(p) is not None:
            sharded.append(p.grad)
        else:
            replicated.append(p.grad)
    dense_sharded, dense_replicated = _sq(sharded), _sq(replicated)
    if dp_sharded[0] or dp_sharded[1]:
        device = (dp_sharded[0] or dp_sharded[1])[0].device
        local = _all_reduce(torch.stack([_sq(part).to(device) for part in dp_sharded]), parallel.data_group)
        dense_sharded, dense_replicated = dense_sharded + local[0], dense_replicated + local[1]
    if group_size(tp_group) > 1:
        dense_sharded = _all_reduce(dense_sharded, tp_group)
    dense = dense_sharded + dense_replicated
    expert = torch.zeros((), dtype=torch.float32)
    for (size, split), grads in experts.items():
        part = _sq(grads)
        group = parallel.expert_groups_of(size).group
        if group is not None:
            part = _all_reduce(part, group)
        if split and group_size(tp_group) > 1:
            part = _all_reduce(part, tp_group)
        expert = expert + part
    if group_size(pipeline_group) > 1:
        dense, expert = _all_reduce(torch.stack([dense, expert.to(dense.device)]), pipeline_group).unbind()
    return dense, expert


def grad_norm(params: Iterable[torch.Tensor], parallel: ParallelContext, kappa: float = 1.0) -> GradNorm:
    """``||(g_d, kappa g_s)||_2`` with its dense and expert parts, over ``parallel``'s groups."""
    dense_sq, expert_sq = squared_norm_parts(params, parallel)
    return GradNorm(dense_sq.sqrt(), expert_sq.sqrt(), (dense_sq + kappa**2 * expert_sq).sqrt())


def norm_and_clip_(
    params: list[Any], max_norm: float, parallel: ParallelContext | None, kappa: float = 1.0, aggregate_norm_fn=None,
) -> Tuple[GradNorm, torch.Tensor]:
    """The norm of the gradients of ``params`` (all with a gradient; flat fp16 masters split
    into their sources) over ``parallel``'s groups (``None``: one process; a one-line error in a run
    of several) and the total, aggregated by ``aggregate_norm_fn`` if given, on the gradients'
    device; clips them when ``max_norm > 0``."""
    if parallel is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise TsConfigError(
                f"the gradient norm of a {dist.get_world_size()}-rank run needs the run's parallel context: train with "
                "the plugin's trainer (fairseq-train --user-dir torchscale_fairseq), which gives it to the optimizer"
            )
        parallel = ParallelContext.single_process()
    norm = grad_norm(list(flat_master_views(params)), parallel, kappa)
    total = norm.total.to(params[0].grad.device)
    if aggregate_norm_fn is not None:
        total = aggregate_norm_fn(total)
    if max_norm > 0:
        clip_grads_(params, float(max_norm), total)
    return norm, total


def clip_grads_(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """``g <- xi / (||g|| + 1e-6) * g`` for every gradient where ``||g|| > xi`` (a non-finite norm
    clips nothing), decided on the device: no host read. The factor is formed in float64, as a
    Python float would be, and rounded once to the gradients' dtype (1 where nothing is clipped)."""
    grads = [local_shard(p.grad.detach()) for p in params if p is not None and p.grad is not None]
    if max_norm <= 0 or not grads:
        return
    clips = torch.isfinite(total_norm) & (total_norm > max_norm)
    coef = torch.where(clips, max_norm / (total_norm.double() + 1e-6), 1.0)
    for dtype in {g.dtype for g in grads}:
        torch._foreach_mul_([g for g in grads if g.dtype == dtype], coef.to(dtype))
