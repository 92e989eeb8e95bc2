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

The plan has a fixed shape, so that routing makes the host wait for nothing (a GPU keeps its
stream; ``torch.compile`` sees static shapes): every token's ``k`` candidate assignments are
listed, choice rank by choice rank, padding tokens and dropped assignments included, with a
``kept`` mask and a zero gate where not kept. The capacity ``ceil(f T k / E)`` (at most ``T``)
counts the real tokens ``T`` as a device tensor when a padding mask is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchscale_fairseq.modules.moe.capacity import assign_slots, expert_capacity, expert_counts
from torchscale_fairseq.modules.moe.experts import RowGroups


@dataclass
class Routing:
    """Candidate assignments ``a`` (fixed count): token ``token[a]`` to slot ``slot[a]`` of expert
    ``expert[a]`` with weight ``gate[a]`` when ``kept[a]`` (else gate 0); ``first_expert`` (T,)
    each token's first choice, ``real`` (T,) its padding mask inverted (``None``: every token
    real); ``load`` (E,) the assignments asked of each expert before dropping; ``routed`` and
    ``dropped`` the assignments asked for and dropped (0-d tensors)."""

    token: torch.Tensor
    expert: torch.Tensor
    slot: torch.Tensor
    gate: torch.Tensor
    kept: torch.Tensor
    first_expert: torch.Tensor
    real: torch.Tensor | None
    load: torch.Tensor
    routed: torch.Tensor
    dropped: torch.Tensor

    def kept_assignments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(token, expert, slot, gate)`` of the kept assignments only (reads the mask on the host)."""
        keep = self.kept
        return self.token[keep], self.expert[keep], self.slot[keep], self.gate[keep]


@dataclass
class DispatchPlan:
    """The rows the experts compute, grouped by expert: row ``r`` is token ``token[r]`` with
    weight ``gate[r]``; ``counts[e]`` rows for expert ``e`` (the kept assignments), then the rest
    (gate 0, computed by no expert). All ``T k`` rows, so the shapes never depend on the routing. ``groups``: the
    same rows as the grouped GEMMs take them, made here so that a compiled routing makes them too."""

    token: torch.Tensor
    gate: torch.Tensor
    counts: torch.Tensor
    groups: RowGroups


def dispatch_plan(routing: Routing, num_experts: int) -> DispatchPlan:
    """Each assignment's row without sorting again: a kept one goes to ``start[e] + slot`` (``start``
    the exclusive cumulative kept count per expert; kept slots are ``0 .. n_e - 1`` in priority
    order), the others after all kept rows in their given order: the order of a stable sort by
    expert with the unkept last."""
    kept = routing.kept
    expert = torch.where(kept, routing.expert, num_experts)
    counts = expert_counts(expert, num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts  # int64: cumsum promotes
    unkept_rank = torch.cumsum(~kept, 0) - 1
    row = torch.where(kept, starts[expert] + routing.slot, starts[num_experts] + unkept_rank)
    # int32 token ids: inductor scatters them in its own kernel (int64 values fall back to PyTorch's scatter_)
    token = torch.empty_like(routing.token, dtype=torch.int32).scatter_(0, row, routing.token.int())
    gate = torch.empty_like(routing.gate).scatter_(0, row, routing.gate)
    return DispatchPlan(token, gate, counts[:num_experts], RowGroups.of(counts[:num_experts], row.numel()))


def real_token_count(num_tokens: int, real: torch.Tensor | None) -> int | torch.Tensor:
    """``num_tokens`` without a padding mask, else the real tokens as a 0-d tensor (no host read)."""
    return num_tokens if real is None else real.sum()


def top_k_routing(
    probs: torch.Tensor,
    top_k: int,
    capacity_factor: float,
    second_expert_policy: str = "random",
    normalize_before_dropping: bool = False,
    training: bool = True,
    bias: torch.Tensor | None = None,
    real: torch.Tensor | None = None,
) -> Routing:
    """Token-choice routing of ``probs`` (T, E); ``bias`` (E,): added for the choice only;
    ``real`` (T,): the tokens to route (padding: none of its assignments is kept)."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(real_token_count(num_tokens, real), num_experts, top_k, capacity_factor)
    if bias is None:
        gates, experts = probs.topk(top_k, dim=-1)
    else:
        experts = (probs.detach() + bias.to(probs.dtype)).topk(top_k, dim=-1).indices
        gates = probs.gather(1, experts)
    first = experts[:, 0]
    active = torch.ones_like(experts, dtype=torch.bool) if real is None else real.unsqueeze(1).expand_as(experts)
    if top_k == 1:
        g = [gates[:, 0]]
    else:
        policy = second_expert_policy if training and top_k == 2 else "all"
        if policy == "sampling":
            experts = torch.stack([first, gumbel_second_expert(probs, first)], dim=1)
        g = [gates[:, 0], probs.gather(1, experts[:, 1:2]).squeeze(1), *gates[:, 2:].unbind(1)]
        if normalize_before_dropping:
            denom = sum(g[1:], g[0]).clamp(min=torch.finfo(g[0].dtype).eps)
            g = [gi / denom for gi in g]
        if policy in ("random", "coin"):
            draw = torch.rand_like(g[1])
            second_on = 2 * g[1].detach() > draw if policy == "random" else draw < 0.5
            active = torch.cat([active[:, :1], active[:, 1:2] & second_on.unsqueeze(1), active[:, 2:]], dim=1)
    expert = experts.t().reshape(-1)
    token = torch.arange(num_tokens, device=probs.device).repeat(top_k)
    gate = torch.stack(g).reshape(-1)
    active = active.t().reshape(-1)
    slot = assign_slots(torch.where(active, expert, num_experts), num_experts + 1)
    keep = active & (slot < capacity)
    if top_k > 1 and not normalize_before_dropping:
        kept_gate = torch.where(keep, gate, torch.zeros_like(gate))
        kept_sum = torch.zeros(num_tokens, dtype=gate.dtype, device=gate.device).index_add(0, token, kept_gate)
        gate = gate / kept_sum.clamp(min=torch.finfo(gate.dtype).eps)[token]
    load = torch.zeros(num_experts, dtype=torch.float32, device=probs.device).index_add(0, expert, active.float())
    routed = active.sum()
    return Routing(token, expert, slot, torch.where(keep, gate, torch.zeros_like(gate)), keep, first, real,
                   load, routed, routed - keep.sum())


def gumbel_second_expert(probs: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``argmax_{e != first} (log p_e + G_e)``, ``G ~ Gumbel(0, 1)`` drawn as fairseq's
    ``gumbel_rsample`` draws it (``torch.distributions.Gumbel(0, 1).rsample``), without its argument
    checks (they read the device tensors ``0`` and ``1`` on the host)."""
    zero = probs.new_zeros(())
    noise = torch.distributions.Gumbel(zero, zero + 1.0, validate_args=False).rsample(probs.shape)
    noisy = probs.detach().log() + noise
    return noisy.scatter(1, first.unsqueeze(1), float("-inf")).argmax(dim=1)


def expert_choice_routing(probs: torch.Tensor, top_k: int, capacity_factor: float,
                          real: torch.Tensor | None = None) -> Routing:
    """Each expert takes its ``C = ceil(f T k / E)`` highest-scoring real tokens (``C`` is read on
    the host: ``topk`` needs it)."""
    num_tokens, num_experts = probs.shape
    count = real_token_count(num_tokens, real)
    capacity = expert_capacity(int(count), num_experts, top_k, capacity_factor)
    scores = probs if real is None else probs.masked_fill(~real.unsqueeze(1), -1.0)
    gate, token = scores.t().topk(capacity, dim=-1)
    expert = torch.arange(num_experts, device=probs.device).unsqueeze(1).expand_as(token).reshape(-1)
    slot = torch.arange(capacity, device=probs.device).unsqueeze(0).expand_as(token).reshape(-1)
    token, gate = token.reshape(-1), probs.t().gather(1, token.view(num_experts, -1)).reshape(-1)
    kept = torch.ones_like(token, dtype=torch.bool)
    served = torch.zeros(num_tokens, dtype=torch.bool, device=probs.device).index_fill_(0, token, True)
    unserved = (~served).sum() if real is None else (real & ~served).sum()
    load = torch.full((num_experts,), float(capacity), device=probs.device)
    routed = count if isinstance(count, torch.Tensor) else torch.full((), count, dtype=torch.long, device=probs.device)
    return Routing(token, expert, slot, gate, kept, probs.argmax(dim=-1), real, load, routed, unserved)
