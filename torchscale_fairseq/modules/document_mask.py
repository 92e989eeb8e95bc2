"""Attention within documents of a packed block (``--document-masking``).

A block packs several documents; ``document_ids`` ``(B, T)`` numbers them per token (equal id =
same document, ids non-decreasing along a row). Query ``i`` may attend key ``j`` iff
``doc[i] == doc[j]`` (and ``j <= i`` when causal), so every document sees only itself, as if it
ran alone.

The mask is one boolean ``(B, 1, T, T)`` tensor per batch, built once and shared by every layer
and head, for ``F.scaled_dot_product_attention``. Chosen over FlexAttention block masks
(``torch.nn.attention.flex_attention``): flex attention has no attention dropout
(``--attention-dropout``, drawn from the tensor-parallel stream), its CPU path is a reference that
materialises the scores unless compiled, and a compiled block mask is a new graph input per batch;
the boolean SDPA mask keeps one attention path for dropout, selective recomputation, tensor
parallelism and ``--ts-compile``, at ``B * T^2`` bytes per batch (CUDA SDPA then takes the
memory-efficient kernel, not flash).
"""

from __future__ import annotations

import torch


def document_attention_mask(document_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """``allowed[b, 0, i, j] = doc[b, i] == doc[b, j]`` (and ``j <= i`` when ``causal``)."""
    allowed = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    if causal:
        t = document_ids.size(1)
        allowed = allowed & torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    return allowed
