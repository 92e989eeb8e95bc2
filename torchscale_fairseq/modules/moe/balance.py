"""Load-balancing loss and routing statistics.

Balance loss (Switch/GShard): ``L = E * sum_e f_e * p_e`` over non-padding tokens, with
``f_e`` the fraction of tokens whose first choice is ``e`` and ``p_e`` the mean router
probability of ``e``; uniform routing gives ``L = 1``. Under expert parallelism the
counts are summed over the data-parallel group (``f`` is global) and each rank returns
its share ``E * sum_e f_e * s_e / N`` (``s_e``: the rank's probability sum, ``N``: all
tokens), so the shares add up to the loss of the whole global batch.
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


def balance_loss(probs: torch.Tensor, first_expert: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """``E * sum_e f_e p_e`` (see the module docstring); ``group`` sums over ranks."""
    num_tokens, num_experts = probs.shape
    counts = torch.bincount(first_expert, minlength=num_experts).to(torch.float32)
    totals = torch.cat([counts, counts.new_tensor([float(num_tokens)])])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    n = totals[-1].clamp(min=1.0)
    f = totals[:num_experts] / n
    return num_experts * (f * probs.float().sum(0)).sum() / n


def routing_stats(probs: torch.Tensor, requested: torch.Tensor, routed: int, dropped: int) -> RoutingStats:
    """``requested``: the expert of every requested assignment (before dropping)."""
    num_experts = probs.size(1)
    with torch.no_grad():
        load = torch.bincount(requested, minlength=num_experts).float()
        cv = float(load.std(unbiased=False) / load.mean().clamp(min=1e-9)) if load.numel() > 1 else 0.0
        p = probs.detach().float()
        entropy = float(-(p * p.clamp(min=1e-12).log()).sum())
    return RoutingStats(int(probs.size(0)), cv, dropped, routed, entropy)
