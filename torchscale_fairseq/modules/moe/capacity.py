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


def expert_capacity(num_tokens: int | torch.Tensor, num_experts: int, top_k: int,
                    capacity_factor: float) -> int | torch.Tensor:
    """``num_tokens``: an int, or a 0-d tensor (the real tokens of a padded batch, kept on the
    device: the capacity is then a 0-d tensor, computed in float64 as the int version)."""
    if capacity_factor <= 0:
        return num_tokens
    if isinstance(num_tokens, torch.Tensor):
        wanted = torch.ceil(num_tokens.double() * capacity_factor * top_k / num_experts)  # the int version's order
        return torch.minimum(num_tokens, wanted.to(num_tokens.dtype))
    return min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def expert_counts(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of ``expert``'s entries name each of ``num_experts`` experts, int32: an ``index_add``, not
    ``bincount``, whose output size would be read on the host; in int32, not int64, which inductor cannot add
    atomically (it falls back to PyTorch's ``index_put_``, which on CUDA sorts the indices first)."""
    return torch.zeros(num_experts, dtype=torch.int32, device=expert.device).index_add_(
        0, expert, torch.ones_like(expert, dtype=torch.int32))


def by_expert(expert: torch.Tensor) -> torch.Tensor:
    """The stable order of ``expert``'s entries by expert, sorted as int32 keys (PyTorch's CUDA radix sort makes
    one pass per 8 bits of the key's type: half those of int64)."""
    return torch.sort(expert.int(), stable=True).indices


def assign_slots(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rank of every assignment within its expert, in the given (priority) order."""
    if expert.numel() == 0:
        return expert.clone()
    order = by_expert(expert)
    counts = expert_counts(expert, num_experts)
    starts = torch.cumsum(counts, 0) - counts  # int64: cumsum promotes
    slot = torch.empty_like(expert)
    slot[order] = torch.arange(expert.numel(), device=expert.device) - starts[expert[order]]
    return slot
