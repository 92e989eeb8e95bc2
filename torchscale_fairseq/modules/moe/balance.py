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

Under context parallelism the ``C`` ranks of a context-parallel group each hold chunks of the
same micro-batch: "this rank's micro-batch" above means the group's. The statistics of
:func:`micro_batch_totals` are summed over the group (Megatron-core reduces its router's token
counts over the tensor x context-parallel group too), each rank's balance loss is its share as in
the global scope, its z-loss ``sum_t z_t / N`` over its tokens with ``N`` the group's, so the
shares add up to the loss of ``C = 1``; the global scope sums the counts over the data-parallel
x context-parallel group.
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
    each expert in the micro-batch, the context-parallel group's), ``dropped`` assignments out of
    ``routed``, and the summed routing entropy ``sum_t H(p_t)``."""

    tokens: torch.Tensor
    load_cv: torch.Tensor
    dropped: torch.Tensor
    routed: torch.Tensor
    entropy_sum: torch.Tensor


@dataclass
class MoEAux:
    """What one MoE layer's forward returns beside its output (TorchScale's ``l_aux``):
    the ``balance_loss`` and the router ``z_loss`` (scalar tensors), the routing ``stats``, the
    :class:`~.aux_loss.AuxLossScale` its losses were differentiated with (``None``: none set),
    whose sample sizes weigh the logged figures, and the layer's ``tag``, set outside compiled
    code (a string a compiled graph reads is guarded by value: one recompilation per layer)."""

    balance_loss: torch.Tensor
    z_loss: torch.Tensor
    stats: RoutingStats
    scale: AuxLossScale | None = None
    tag: str = ""


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


def micro_batch_totals(first_expert: torch.Tensor, load: torch.Tensor, context_group: object | None = None,
                       real: torch.Tensor | None = None) -> torch.Tensor:
    """``[c_1, ..., c_E, N, l_1, ..., l_E]``: :func:`choice_totals` and the assignments asked of each
    expert (``load``) of this rank's tokens, summed over ``context_group`` (the ranks holding the
    micro-batch's other chunks; ``None``: this rank's tokens are the micro-batch)."""
    totals = torch.cat([choice_totals(first_expert, load.numel(), None, real), load.float()])
    if context_group is not None and dist.is_initialized() and dist.get_world_size(context_group) > 1:
        dist.all_reduce(totals, group=context_group)
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


def router_z_loss(scores: torch.Tensor, real: torch.Tensor | None = None,
                  tokens: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_t (logsumexp_e s_te)^2 / N`` of the router scores ``(T, E)`` over the real tokens, in
    fp32; ``N``: ``tokens`` (the micro-batch's real tokens under context parallelism) or the real
    tokens here (the mean; 0 for none)."""
    z = torch.logsumexp(scores.float(), dim=-1).square()
    total = z.sum() if real is None else (z * real).sum()
    if tokens is not None:
        return total / tokens.clamp(min=1)
    return total / (max(scores.size(0), 1) if real is None else real.sum().clamp(min=1))


def routing_stats(probs: torch.Tensor, routing, load: torch.Tensor | None = None) -> RoutingStats:
    """The statistics of one routing (a :class:`~.gating.Routing`), without host reads; ``load``:
    the micro-batch's assignments per expert for the load CV (``None``: the routing's)."""
    with torch.no_grad():
        load = routing.load if load is None else load
        cv = load.std(unbiased=False) / load.mean().clamp(min=1e-9) if load.numel() > 1 else load.new_zeros(())
        p = probs.detach().float()
        plogp = p * p.clamp(min=1e-12).log()
        real = routing.real
        tokens = (torch.full((), probs.size(0), dtype=torch.long, device=probs.device) if real is None
                  else real.sum())  # a fill on the device (compiled: of a dynamic token count)
        # the entropies' sum as one flat T x E sum: a per-token entropy summed beside the z-loss's sum and the
        # clamped token count fused into one reduction that Triton 3.6 cannot compile (triton-lang/triton#8257)
        entropy_sum = -(plogp.sum() if real is None else (plogp * real.unsqueeze(1)).sum())
    return RoutingStats(tokens, cv, routing.dropped, routing.routed, entropy_sum)
