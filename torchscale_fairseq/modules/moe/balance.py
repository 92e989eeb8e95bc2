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

from torchscale_fairseq.modules.moe.aux_loss import AuxLossScale


@dataclass
class RoutingStats:
    """Per-layer figures for the logs, as 0-d tensors (read on the host once per step, by the
    criterion): ``tokens`` routed here, expert load CV (std / mean of the assignments asked of
    each expert), ``dropped`` assignments out of ``routed``, and the summed routing entropy
    ``sum_t H(p_t)``."""

    tokens: torch.Tensor
    load_cv: torch.Tensor
    dropped: torch.Tensor
    routed: torch.Tensor
    entropy_sum: torch.Tensor


@dataclass
class MoEAux:
    """What one MoE layer's forward returns beside its output (TorchScale's ``l_aux``):
    its ``tag``, the ``balance_loss`` and the router ``z_loss`` (scalar tensors), the routing
    ``stats`` and the :class:`~.aux_loss.AuxLossScale` its losses were differentiated with
    (``None``: none set), whose sample sizes weigh the logged figures."""

    tag: str
    balance_loss: torch.Tensor
    z_loss: torch.Tensor
    stats: RoutingStats
    scale: AuxLossScale | None = None


def _real_weights(rows: int, real: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """1 for a real token, 0 for padding (``real`` ``None``: every token real), as ``like``'s float type."""
    return torch.ones(rows, dtype=torch.float32, device=like.device) if real is None else real.float()


def choice_totals(first_expert: torch.Tensor, num_experts: int, group: object | None = None,
                  real: torch.Tensor | None = None) -> torch.Tensor:
    """``[c_1, ..., c_E, N]``: first-choice counts of the real tokens per expert and their count,
    summed over ``group`` (the global scope; ``None``: this rank's micro-batch)."""
    weights = _real_weights(first_expert.numel(), real, first_expert)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=first_expert.device).index_add_(
        0, first_expert, weights)
    totals = torch.cat([counts, weights.sum().unsqueeze(0)])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    return totals


def balance_loss(probs: torch.Tensor, first_expert: torch.Tensor, group: object | None = None,
                 totals: torch.Tensor | None = None, real: torch.Tensor | None = None) -> torch.Tensor:
    """``E * sum_e f_e p_e`` over the real tokens (see the module docstring): local with
    ``group=None``, global (this rank's share) over ``group``. ``totals``: the
    :func:`choice_totals` already counted (an activation-checkpointing recomputation reuses its
    forward's)."""
    num_experts = probs.size(1)
    if totals is None:
        totals = choice_totals(first_expert, num_experts, group, real)
    n = totals[-1].clamp(min=1.0)
    f = totals[:num_experts] / n
    p = probs.float() if real is None else probs.float() * real.unsqueeze(1)
    return num_experts * (f * p.sum(0)).sum() / n


def router_z_loss(scores: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """``mean_t (logsumexp_e s_te)^2`` of the router scores ``(T, E)`` over the real tokens
    (0 for none), in fp32."""
    z = torch.logsumexp(scores.float(), dim=-1).square()
    if real is None:
        return z.sum() / max(scores.size(0), 1)
    return (z * real).sum() / real.sum().clamp(min=1)


def routing_stats(probs: torch.Tensor, routing) -> RoutingStats:
    """The statistics of one routing (a :class:`~.gating.Routing`), without host reads."""
    with torch.no_grad():
        load = routing.load
        cv = load.std(unbiased=False) / load.mean().clamp(min=1e-9) if load.numel() > 1 else load.new_zeros(())
        p = probs.detach().float()
        entropy = -(p * p.clamp(min=1e-12).log()).sum(-1)
        real = routing.real
        tokens = torch.as_tensor(probs.size(0), device=probs.device) if real is None else real.sum()
        entropy_sum = entropy.sum() if real is None else (entropy * real).sum()
    return RoutingStats(tokens, cv, routing.dropped, routing.routed, entropy_sum)
