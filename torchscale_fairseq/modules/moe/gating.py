"""From router scores to a routing plan: which token goes to which expert slot, with
which combine weight.

Token choice (Switch, GShard, fine-grained top-k up to 8), on ``p = softmax(s)``:
- top-1 (Switch): gate ``p_e1``;
- top-k, k >= 3 (fine-grained experts, DeepSeekMoE; Megatron-core's top-k): every chosen expert
  is kept, gates ``p_ei`` normalised over the kept ones as for top-2;
- top-2 (GShard): gates ``p_e1, p_e2``. The second-expert policies are those of fairseq's
  MoE branch and TorchScale (``top2gating``): ``all`` keeps the second-best expert;
  ``random`` keeps it when ``2 g_2 > U(0, 1)`` (``g_2 = p_e2``, or ``p_e2 / (p_e1 + p_e2)``
  with ``--moe-normalize-gate-prob-before-dropping``); ``sampling`` draws the second expert
  by the Gumbel-max trick, ``argmax_{e != e1} (log p_e + G_e)``, ``G ~ Gumbel(0, 1)``, and
  keeps it; ``coin`` (not upstream) keeps the second-best expert with probability 1/2.
  Evaluation always uses ``all``. Gates are normalised to sum to 1 over the kept experts
  either before capacity dropping (``--moe-normalize-gate-prob-before-dropping``) or after
  it (default).
Auxiliary-loss-free balancing (DeepSeek-V3, section 2.1.2): with a per-expert ``bias``, the
experts are chosen by ``p + bias`` (the top-k, and the top-2 ``random`` policy's second
expert), while the gates stay ``p`` of the chosen experts.
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
    second_expert_policy: str = "random",
    normalize_before_dropping: bool = False,
    training: bool = True,
    bias: torch.Tensor | None = None,
) -> Routing:
    """Token-choice routing of ``probs`` (T, E); ``bias`` (E,): added for the choice only."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, top_k, capacity_factor)
    if bias is None:
        gates, experts = probs.topk(top_k, dim=-1)
    else:
        experts = (probs.detach() + bias.to(probs.dtype)).topk(top_k, dim=-1).indices
        gates = probs.gather(1, experts)
    tokens = torch.arange(num_tokens, device=probs.device)
    first = experts[:, 0]
    if top_k == 1:
        slot = assign_slots(first, num_experts)
        keep = slot < capacity
        return Routing(tokens[keep], first[keep], slot[keep], gates[keep, 0], capacity, first, first,
                       num_tokens, int((~keep).sum()))
    policy = second_expert_policy if training and top_k == 2 else "all"
    second = experts[:, 1] if policy != "sampling" else gumbel_second_expert(probs, first)
    others = [second, *experts[:, 2:].unbind(1)]
    g = [gates[:, 0], probs.gather(1, second.unsqueeze(1)).squeeze(1), *gates[:, 2:].unbind(1)]
    if normalize_before_dropping:
        denom = sum(g[1:], g[0]).clamp(min=torch.finfo(g[0].dtype).eps)
        g = [gi / denom for gi in g]
    if policy == "random":
        second_on = 2 * g[1].detach() > torch.rand_like(g[1])
    elif policy == "coin":
        second_on = torch.rand_like(g[1]) < 0.5
    else:
        second_on = torch.ones_like(g[1], dtype=torch.bool)
    expert = torch.cat([first, others[0][second_on], *others[1:]])
    token = torch.cat([tokens, tokens[second_on], *[tokens] * (top_k - 2)])
    gate = torch.cat([g[0], g[1][second_on], *g[2:]])
    slot = assign_slots(expert, num_experts)
    keep = slot < capacity
    if not normalize_before_dropping:
        kept_sum = torch.zeros(num_tokens, dtype=gate.dtype, device=gate.device).index_add(
            0, token[keep], gate[keep]
        )
        gate = gate / kept_sum.clamp(min=torch.finfo(gate.dtype).eps)[token]
    return Routing(token[keep], expert[keep], slot[keep], gate[keep], capacity, first, expert,
                   int(expert.numel()), int((~keep).sum()))


def gumbel_second_expert(probs: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``argmax_{e != first} (log p_e + G_e)``, ``G ~ Gumbel(0, 1)`` drawn as fairseq's
    ``gumbel_rsample`` draws it (``torch.distributions.Gumbel(0, 1).rsample``)."""
    zero = probs.new_zeros(())
    noise = torch.distributions.Gumbel(zero, zero + 1.0).rsample(probs.shape)
    noisy = probs.detach().log() + noise
    return noisy.scatter(1, first.unsqueeze(1), float("-inf")).argmax(dim=1)


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
