"""The gradient norm of every fairseq optimizer the trainer builds (the fp16/AMP wrappers call its
``clip_grad_norm``), in place of ``fairseq.utils.clip_grad_norm_``, computed with
:func:`torchscale_fairseq.optim.grad_norm.grad_norm`: every gradient counted once (tensor-parallel
shards summed over the tensor-parallel group, replicated parameters once, pipeline stages summed,
expert gradients included, ``kappa = 1``). Without tensor parallelism and experts it is fairseq's
``||g||_2``. A flat fp16 master is split back into per-parameter views (the trainer gives it its
sources).

The groups are the run's parallel context, given as an argument: the trainer hands its context to
the optimizer it builds (:func:`use_parallel_context`); without one it is the one-process norm (a
run of several processes without it is a one-line error)."""

from __future__ import annotations

import functools

import torch
from fairseq.optim import FairseqOptimizer

from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.optim.grad_norm import norm_and_clip_
from torchscale_fairseq.optim.sparse_clip import SparseClip


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, aggregate_norm_fn=None,
                    parallel: ParallelContext | None = None) -> torch.Tensor:
    """Drop-in for ``fairseq.utils.clip_grad_norm_``: returns the total norm over ``parallel``'s
    groups (``None``: one process) and scales the gradients by ``max_norm / ||g||`` when that is
    below 1 (``max_norm > 0``)."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in params if p is not None]
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return params[0].new_tensor(0.0) if params else torch.tensor(0.0)
    return norm_and_clip_(with_grad, max_norm, parallel, 1.0, aggregate_norm_fn)[1]


def _optimizer_clip_grad_norm(optimizer: FairseqOptimizer, parallel: ParallelContext, max_norm: float,
                              aggregate_norm_fn=None) -> torch.Tensor:
    """``FairseqOptimizer.clip_grad_norm`` over ``parallel``'s groups."""
    return clip_grad_norm_(optimizer.params, max_norm, aggregate_norm_fn, parallel)


def use_parallel_context(optimizer: FairseqOptimizer, parallel: ParallelContext) -> None:
    """Make the fairseq optimizer ``optimizer`` (the one inside the precision wrappers, whose
    ``clip_grad_norm`` they call) take its gradient norm over ``parallel``'s groups."""
    if isinstance(optimizer, SparseClip):
        optimizer.parallel = parallel
    else:
        optimizer.clip_grad_norm = functools.partial(_optimizer_clip_grad_norm, optimizer, parallel)
