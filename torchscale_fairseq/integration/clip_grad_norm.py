"""``fairseq.utils.clip_grad_norm_`` (called by every fairseq optimizer, the fp16/AMP
wrappers included) computed with :func:`torchscale_fairseq.optim.grad_norm.grad_norm`:
every gradient counted once (tensor-parallel shards summed over the tensor-parallel
group, replicated parameters once, pipeline stages summed, expert gradients included, ``kappa = 1``). Without
tensor parallelism and experts it is fairseq's ``||g||_2``. A flat fp16 master is split
back into per-parameter views (the trainer gives it its sources)."""

from __future__ import annotations

import torch
from fairseq import utils

from torchscale_fairseq.model_parallel.parallel_context import current_parallel_context
from torchscale_fairseq.optim.grad_norm import norm_and_clip_

STOCK_CLIP_GRAD_NORM = utils.clip_grad_norm_


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, aggregate_norm_fn=None) -> torch.Tensor:
    """Drop-in for ``fairseq.utils.clip_grad_norm_``: returns the total norm and scales
    the gradients by ``max_norm / ||g||`` when that is below 1 (``max_norm > 0``)."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in params if p is not None]
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return params[0].new_tensor(0.0) if params else torch.tensor(0.0)
    parallel = current_parallel_context()
    return norm_and_clip_(with_grad, max_norm, 1.0, parallel.tensor_group, aggregate_norm_fn,
                          parallel.pipeline_group)[1]
