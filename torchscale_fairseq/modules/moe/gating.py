"""From router scores to a routing plan: which token goes to which expert slot, with
which combine weight.

Token choice (GShard/Switch, top-1 or top-2), on ``p = softmax(s)``:
- top-1 (Switch): gate ``p_e1``;
- top-2 (GShard): gates ``p_e1, p_e2``; the second expert is kept with probability
  ``min(1, 2 p_e2 / (p_e1 + p_e2))`` (``sampling``), always (``all``) or with
  probability 1/2 (``random``); evaluation always uses ``all``. Gates are normalised to
  sum to 1 over the kept experts either before capacity dropping
  (``--moe-normalize-gate-prob-before-dropping``) or after it (default).
Expert choice (Zhou et al. 2022): each expert takes its top-``C`` tokens by ``p``,
gate ``p_{t,e}``; a token may get any number of experts, including none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchscale_fairseq.modules.moe.capacity import assign_slots, expert_capacity


@dataclass
class Routing:
    """Assignments ``a``: token ``token[a]`` to slot ``slot[a]`` of expert ``expert[a]``
    with weight ``gate[a]``; only assignments with ``slot < capacity`` are listed."""

    token: torch.Tensor
    expert: torch.Tensor
    slot: torch.Tensor
    gate: torch.Tensor
    capacity: int
    first_expert: torch.Tensor
    requested: torch.Tensor
    routed: int
    dropped: int


def top_k_routing(
    probs: torch.Tensor,
    top_k: int,
    capacity_factor: float,
    second_expert_policy: str = "sampling",
    normalize_before_dropping: bool = False,
    training: bool = True,
) -> Routing:
    """Token-choice routing of ``probs`` (T, E)."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, top_k, capacity_factor)
    gates, experts = probs.topk(top_k, dim=-1)
    tokens = torch.arange(num_tokens, device=probs.device)
    first = experts[:, 0]
    if top_k == 1:
        slot = assign_slots(first, num_experts)
        keep = slot < capacity
        return Routing(tokens[keep], first[keep], slot[keep], gates[keep, 0], capacity, first, first,
                       num_tokens, int((~keep).sum()))
    g1, g2 = gates[:, 0], gates[:, 1]
    if normalize_before_dropping:
        denom = (g1 + g2).clamp(min=torch.finfo(g1.dtype).eps)
        g1, g2 = g1 / denom, g2 / denom
    policy = second_expert_policy if training else "all"
    if policy == "sampling":
        ratio = 2 * g2.detach() / (g1.detach() + g2.detach()).clamp(min=torch.finfo(g1.dtype).eps)
        second_on = ratio > torch.rand_like(ratio)
    elif policy == "random":
        second_on = torch.rand_like(g2) < 0.5
    else:
        second_on = torch.ones_like(g2, dtype=torch.bool)
    expert = torch.cat([first, experts[:, 1][second_on]])
    token = torch.cat([tokens, tokens[second_on]])
    gate = torch.cat([g1, g2[second_on]])
    slot = assign_slots(expert, num_experts)
    keep = slot < capacity
    if not normalize_before_dropping:
        kept_sum = torch.zeros(num_tokens, dtype=gate.dtype, device=gate.device).index_add(
            0, token[keep], gate[keep]
        )
        gate = gate / kept_sum.clamp(min=torch.finfo(gate.dtype).eps)[token]
    return Routing(token[keep], expert[keep], slot[keep], gate[keep], capacity, first, expert,
                   int(expert.numel()), int((~keep).sum()))


def expert_choice_routing(probs: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """Each expert takes its ``C = ceil(f T k / E)`` highest-scoring tokens."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, top_k, capacity_factor)
    gate, token = probs.t().topk(capacity, dim=-1)
    expert = torch.arange(num_experts, device=probs.device).unsqueeze(1).expand_as(token)
    slot = torch.arange(capacity, device=probs.device).unsqueeze(0).expand_as(token)
    served = torch.zeros(num_tokens, dtype=torch.bool, device=probs.device)
    served[token.reshape(-1)] = True
    return Routing(token.reshape(-1), expert.reshape(-1), slot.reshape(-1), gate.reshape(-1), capacity,
                   probs.argmax(dim=-1), expert.reshape(-1), num_tokens, int((~served).sum()))
