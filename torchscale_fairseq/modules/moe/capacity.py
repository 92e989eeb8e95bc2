"""Expert capacity and slot assignment by sorting (no one-hot ``T x E x C`` tensors).

Capacity (GShard): ``C = ceil(f * T * k / E)``, at most ``T``; ``f <= 0`` means no
dropping (``C = T``: an expert never gets a token twice). Slots are given in priority
order (all first choices before any second choice, then token order): a stable sort by
expert puts each expert's assignments together and an assignment's slot is its rank
within its expert; slots ``>= C`` overflow and are dropped.
"""

from __future__ import annotations

import math

import torch


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    if capacity_factor <= 0:
        return num_tokens
    return min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def assign_slots(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rank of every assignment within its expert, in the given (priority) order."""
    if expert.numel() == 0:
        return expert.clone()
    order = torch.sort(expert, stable=True).indices
    counts = torch.bincount(expert, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(expert)
    slot[order] = torch.arange(expert.numel(), device=expert.device) - starts[expert[order]]
    return slot
