"""Load-balancing loss and routing statistics.

Balance loss (Switch/GShard): ``L = E * sum_e f_e * p_e`` over non-padding tokens, with
``f_e`` the fraction of tokens whose first choice is ``e`` and ``p_e`` the mean router
probability of ``e``; uniform routing gives ``L = 1``. Its scope (``--moe-balance-scope``):
- ``local`` (fairseq's MoE branch, TorchScale): over this rank's micro-batch alone;
- ``global``: the counts are summed over the data-parallel group (``f`` is global) and
  each rank returns its share ``E * sum_e f_e * s_e / N`` (``s_e``: the rank's probability
  sum, ``N``: all tokens), so the shares add up to the loss of the group's micro-batch.

Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``Z = mean_t (log sum_e exp s_te)^2`` over
this rank's routed tokens, ``s`` the router's scores (logits) before the softmax; it keeps
the scores small, so the router's softmax stays away from saturation in low precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class RoutingStats:
    """Per-layer figures for the logs: ``tokens`` routed here, expert load CV
    (std / mean of assignments per expert), ``dropped`` assignments out of ``routed``,
    and the summed routing entropy ``sum_t H(p_t)``."""

    tokens: int
    load_cv: float
    dropped: int
    routed: int
    entropy_sum: float


@dataclass
class MoEAux:
    """What one MoE layer's forward returns beside its output (TorchScale's ``l_aux``):
    its ``tag``, the ``balance_loss`` and the router ``z_loss`` (scalar tensors), the routing
    ``stats`` and the ``data_parallel_group`` its balance loss was counted over (``None``: the
    local scope)."""

    tag: str
    balance_loss: torch.Tensor
    z_loss: torch.Tensor
    stats: RoutingStats
    data_parallel_group: object | None = None


def choice_totals(first_expert: torch.Tensor, num_experts: int, group: object | None = None) -> torch.Tensor:
    """``[c_1, ..., c_E, N]``: first-choice counts per expert and the token count, summed
    over ``group`` (the global scope; ``None``: this rank's micro-batch)."""
    counts = torch.bincount(first_expert, minlength=num_experts).to(torch.float32)
    totals = torch.cat([counts, counts.new_tensor([float(first_expert.numel())])])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    return totals


def balance_loss(probs: torch.Tensor, first_expert: torch.Tensor, group: object | None = None,
                 totals: torch.Tensor | None = None) -> torch.Tensor:
    """``E * sum_e f_e p_e`` (see the module docstring): local with ``group=None``, global
    (this rank's share) over ``group``. ``totals``: the :func:`choice_totals` already
    counted (an activation-checkpointing recomputation reuses its forward's)."""
    num_experts = probs.size(1)
    if totals is None:
        totals = choice_totals(first_expert, num_experts, group)
    n = totals[-1].clamp(min=1.0)
    f = totals[:num_experts] / n
    return num_experts * (f * probs.float().sum(0)).sum() / n


def router_z_loss(scores: torch.Tensor) -> torch.Tensor:
    """``mean_t (logsumexp_e s_te)^2`` of the router scores ``(T, E)`` (0 for no token), in fp32."""
    return torch.logsumexp(scores.float(), dim=-1).square().sum() / max(scores.size(0), 1)


def routing_stats(probs: torch.Tensor, requested: torch.Tensor, routed: int, dropped: int) -> RoutingStats:
    """``requested``: the expert of every requested assignment (before dropping)."""
    num_experts = probs.size(1)
    with torch.no_grad():
        load = torch.bincount(requested, minlength=num_experts).float()
        cv = float(load.std(unbiased=False) / load.mean().clamp(min=1e-9)) if load.numel() > 1 else 0.0
        p = probs.detach().float()
        entropy = float(-(p * p.clamp(min=1e-12).log()).sum())
    return RoutingStats(int(probs.size(0)), cv, dropped, routed, entropy)
