"""``fairseq.utils.clip_grad_norm_`` (used by every fairseq optimizer, the fp16/AMP
wrappers included) computed with :mod:`torchscale_fairseq.optim.grad_norm`: every
gradient counted once (tensor-parallel shards summed over the tensor-parallel group,
replicated parameters once, expert gradients included, ``kappa = 1``). Without tensor
parallelism and experts it is fairseq's ``||g||_2``.

fp16's fp32 master copies lose the parameter attributes; we carry them over (one
master per parameter) or remember the source parameters of a flat master and split its
gradient back into per-parameter views.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
from fairseq import utils
from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin

from torchscale_fairseq.model_parallel.partition import TP_DIM, TP_STRIDE
from torchscale_fairseq.optim.grad_norm import clip_grads_, grad_norm

_CARRIED = (TP_DIM, TP_STRIDE, "expert", "expert_group")
_FLAT_SOURCES = "ts_flat_sources"
_STOCK_BUILD = _FP16OptimizerMixin.build_fp32_params.__func__
STOCK_CLIP_GRAD_NORM = utils.clip_grad_norm_


def _views(params: list) -> Iterable:
    """Parameters, with a flat fp32 master split into per-source-parameter views."""
    for p in params:
        sources = getattr(p, _FLAT_SOURCES, None)
        if sources is None or p.grad is None:
            yield p
            continue
        flat, offset = p.grad.view(-1), 0
        for src in sources:
            n = src.numel()
            attrs = {a: getattr(src, a) for a in _CARRIED if hasattr(src, a)}
            yield SimpleNamespace(grad=flat[offset : offset + n], **attrs)
            offset += n


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
    total = grad_norm(list(_views(with_grad))).total.to(with_grad[0].grad.device)
    if aggregate_norm_fn is not None:
        total = aggregate_norm_fn(total)
    if max_norm > 0:
        clip_grads_(with_grad, float(max_norm), total)
    return total


@classmethod
def _build_fp32_params(cls, args, params, flatten=True):
    fp32 = _STOCK_BUILD(cls, args, params, flatten)
    if flatten:
        for master in fp32.values():
            setattr(master, _FLAT_SOURCES, list(params))
    else:
        for p, master in zip(params, fp32):
            for a in _CARRIED:
                if hasattr(p, a):
                    setattr(master, a, getattr(p, a))
    return fp32


def patch_clip_grad_norm() -> None:
    utils.clip_grad_norm_ = clip_grad_norm_
    _FP16OptimizerMixin.build_fp32_params = _build_fp32_params
