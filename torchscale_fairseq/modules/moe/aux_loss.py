"""The MoE layers' auxiliary losses inside autograd (Megatron-core's ``MoEAuxLossAutoScaler``).

A criterion's loss is ``base + w S sum_l L_l + w_z S_r sum_l Z_l`` (:mod:`torchscale_fairseq.criterions.moe_terms`);
its gradient with respect to a layer's balance loss ``L_l`` is ``w S`` and to its router z-loss
``Z_l`` is ``w_z S_r``, times the loss scale the optimizer's ``backward`` applies. Rather than adding
the terms to the loss, each MoE layer passes its output through :class:`MoEAuxLossAutoScaler`, whose
backward gives ``L_l`` and ``Z_l`` those gradients: the same gradients, wherever the layer runs (a
pipeline stage before the last differentiates its output with the gradient it receives, and the
aux losses come along). The scales of a micro-batch (:class:`AuxLossScale`) are known before its
forward, since every rank reads its own batches and the sample size follows from them
(:func:`aux_loss_scales`); a layer captures the one set when it runs forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class AuxLossScale:
    """One micro-batch's gradients of the auxiliary losses (0-d fp32 tensors): ``balance`` =
    ``w S`` x loss scale, ``z`` = ``w_z S_r`` x loss scale (both 0 for an ignored batch), with
    ``S`` = ``balance_sample_size`` (summed over the data-parallel group under the global balance
    scope) and ``S_r`` = ``sample_size``, this rank's micro-batch's (under context parallelism the
    whole micro-batch, whose chunks the context-parallel group holds)."""

    balance: torch.Tensor
    z: torch.Tensor
    balance_sample_size: torch.Tensor
    sample_size: torch.Tensor


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """``output`` unchanged; in backward ``d/d balance_loss = balance_scale`` and
    ``d/d z_loss = z_scale``, so the auxiliary losses are differentiated with the output."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, balance_loss: torch.Tensor, z_loss: torch.Tensor,
                balance_scale: torch.Tensor, z_scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(balance_scale.to(balance_loss.dtype), z_scale.to(z_loss.dtype))
        return output.clone()  # (an alias of the input loses the gradients under torch.compile)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        balance_scale, z_scale = ctx.saved_tensors
        return grad_output, balance_scale, z_scale, None, None


def aux_loss_scales(sample_sizes: Sequence[Any], ignored: Sequence[bool], balance_weight: float, z_weight: float,
                    loss_scale: float, device: torch.device, group: Any = None) -> list[AuxLossScale]:
    """The :class:`AuxLossScale` of each micro-batch of an update from its sample size (a number
    or a 0-d tensor) and whether its gradient is ignored (fairseq's dummy batch); ``group``: the
    data-parallel group ``S`` is summed over (the global balance scope; ``None``: this rank's),
    one all-reduce for every micro-batch."""
    local = torch.stack([torch.as_tensor(s, device=device).float().reshape(()) for s in sample_sizes])
    total = local.clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    keep = torch.tensor([0.0 if i else 1.0 for i in ignored], device=device)
    balance = balance_weight * total * keep * loss_scale
    z = z_weight * local * keep * loss_scale
    return [AuxLossScale(balance[i], z[i], total[i], local[i]) for i in range(len(local))]


def set_aux_loss_scale(layers: Iterable[nn.Module], scale: AuxLossScale | None) -> None:
    """The next forward of each MoE layer of ``layers`` runs with ``scale`` (``None``: none attached)."""
    for layer in layers:
        layer.aux_loss_scale = scale
