"""The plugin's ``clip_grad_norm_`` (what the trainer's optimizer clips with) without tensor
parallelism or experts is fairseq's own ``||g||_2`` (and clips the same way); expert gradients count; fp16 master
copies keep the attributes the count-once norm needs."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch
from fairseq import utils
from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin
from torch import nn

from torchscale_fairseq.integration import clip_grad_norm as grad_norm_clip
from torchscale_fairseq.integration.trainer import carry_parallel_attributes
from torchscale_fairseq.model_parallel.attributes import TP_DIM, TP_STRIDE, mark_sharded
from torchscale_fairseq.optim.grad_norm import FLAT_MASTER_SOURCES, flat_master_views


def _model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    model(torch.randn(5, 8)).pow(2).sum().backward()
    return model


def test_fairseq_is_not_patched():
    """The trainer hands its optimizer the context (``use_parallel_context``); fairseq's function stays stock."""
    assert utils.clip_grad_norm_ is not grad_norm_clip.clip_grad_norm_


def test_equals_stock_fairseq_without_tensor_parallelism():
    for max_norm in (0.0, 1e-3, 1e6):
        ours, stock = _model_with_grads(), _model_with_grads()
        total = grad_norm_clip.clip_grad_norm_(list(ours.parameters()), max_norm)
        expected = utils.clip_grad_norm_(list(stock.parameters()), max_norm)
        assert torch.allclose(total, expected, rtol=1e-6, atol=0), (total, expected)
        for a, b in zip(ours.parameters(), stock.parameters()):
            assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-9)


def test_the_clip_is_the_formula_bit_for_bit():
    """Where ``||g|| > xi``: ``g * (xi / (||g|| + 1e-6))``, the factor a Python float; where the norm
    is below ``xi`` or not finite the gradients are unchanged. The clip decides on the device (a
    float64 factor, no host read): the same bits as this host formula must come out."""
    cases, clips = [(seed, max_norm, None) for seed in range(8) for max_norm in (1e-3, 0.07, 0.3, 1e6)], 0
    for seed, max_norm, poison in [*cases, (0, 0.5, float("inf")), (0, 0.5, float("nan"))]:
        params = list(_model_with_grads(seed).parameters())
        if poison is not None:
            params[0].grad[0, 0] = poison
        before = [p.grad.clone() for p in params]
        total = float(grad_norm_clip.clip_grad_norm_(params, max_norm))
        clipped = math.isfinite(total) and total > max_norm
        clips += clipped
        for p, g in zip(params, before):
            expected = g * (max_norm / (total + 1e-6)) if clipped else g
            assert torch.allclose(p.grad, expected, rtol=0, atol=0, equal_nan=True)
    assert clips >= 16


def test_expert_gradients_count():
    model = _model_with_grads()
    params = list(model.parameters())
    params[-1].expert = True
    dense = torch.cat([p.grad.flatten() for p in params[:-1]]).norm()
    total = grad_norm_clip.clip_grad_norm_(params, 0.0)
    assert torch.allclose(total, torch.cat([dense[None], params[-1].grad.flatten()]).norm())
    assert not torch.allclose(total, utils.clip_grad_norm_(params, 0.0))


def test_flat_fp16_master_is_split_back_into_parameters():
    model = _model_with_grads()
    params = list(model.parameters())
    mark_sharded(params[0], 0)
    flat = nn.Parameter(torch.cat([p.detach().flatten() for p in params]))
    flat.grad = torch.cat([p.grad.flatten() for p in params])
    setattr(flat, FLAT_MASTER_SOURCES, params)
    views = list(flat_master_views([flat]))
    assert [v.grad.numel() for v in views] == [p.numel() for p in params]
    assert getattr(views[0], TP_DIM) == 0 and not hasattr(views[1], TP_DIM)
    assert torch.allclose(grad_norm_clip.clip_grad_norm_([flat], 0.0), flat.grad.norm())


def test_unflattened_fp16_masters_keep_the_attributes():
    params = [mark_sharded(nn.Parameter(torch.ones(4, 2)), 0, 2), nn.Parameter(torch.ones(3))]
    params[1].expert = True
    masters = _FP16OptimizerMixin.build_fp32_params(SimpleNamespace(), copy.copy(params), flatten=False)
    carry_parallel_attributes(SimpleNamespace(fp16_params=params, fp32_params=masters))
    assert getattr(masters[0], TP_DIM) == 0 and getattr(masters[0], TP_STRIDE) == 2
    assert masters[1].expert is True and not hasattr(masters[1], TP_DIM)
