"""Which keys a query may attend, and the additive mask of a packed batch (``--document-masking``).

A block packs several documents; ``document_ids`` ``(B, T)`` numbers them per token (equal id =
same document, ids non-decreasing along a row). Query ``i`` may attend key ``j`` iff
``doc[i] == doc[j]`` (and ``j <= i`` when causal), so every document sees only itself, as if it
ran alone. :func:`allowed_keys` is the one rule for causality, key padding and documents;
attention builds its per-layer masks with it too.

The document mask is one additive ``(B, 1, T, T)`` tensor per batch (``0`` where allowed,
``-inf`` elsewhere) in the attention's compute dtype, built once by the stack and shared by every
layer and head of ``F.scaled_dot_product_attention``: SDPA converts a boolean mask into such a
float tensor on every call (and keeps that copy for backward), an additive one of the query's
dtype it takes as it is. Rows are stored with a multiple of 8 entries (a view cut to ``T``), the
stride alignment CUDA's memory-efficient kernel needs to take the mask without padding a copy.
Chosen over FlexAttention block masks (``torch.nn.attention.flex_attention``): flex attention has
no attention dropout (``--attention-dropout``, drawn from the tensor-parallel stream), its CPU path
is a reference that materialises the scores unless compiled, and a compiled block mask is a new
graph input per batch; the SDPA mask keeps one attention path for dropout, selective
recomputation, tensor and sequence parallelism and ``--ts-compile``, at ``B * T^2`` elements per
batch (CUDA SDPA then takes the memory-efficient kernel, not flash).
"""

from __future__ import annotations

from typing import Optional

import torch

MASK_ROW_ALIGNMENT = 8  # elements; CUDA memory-efficient SDPA copies masks with other strides


def allowed_keys(
    t: int, s: int, causal: bool, device: torch.device, key_padding_mask: Optional[torch.Tensor] = None,
    document_ids: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Boolean ``(1|B, 1, t, s)`` (``None``: every key), True where query ``i`` (the last ``t`` of ``s``
    positions) may attend key ``j``: ``j <= i + s - t`` when ``causal`` (and ``t > 1``), key ``j`` not
    padding (``key_padding_mask`` ``(B, s)`` True at pads; under ``causal`` every query keeps itself,
    so a left-padded row is never empty), and ``doc[i] == doc[j]`` (``document_ids`` ``(B, s)``, ``t == s``)."""
    allowed = None
    if document_ids is not None:
        allowed = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    if causal and t > 1:
        lower = torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)[None, None]
        allowed = lower if allowed is None else allowed & lower
    if key_padding_mask is not None:
        keys = ~key_padding_mask[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
        if causal:
            itself = torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t).triu(s - t)
            allowed = allowed | itself[None, None]
    return allowed


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``0`` where ``allowed``, ``-inf`` elsewhere, in ``dtype`` (rows stored aligned, module docstring)."""
    *lead, s = allowed.shape
    stored = -(-s // MASK_ROW_ALIGNMENT) * MASK_ROW_ALIGNMENT
    mask = torch.zeros(*lead, stored, dtype=dtype, device=allowed.device)[..., :s]
    return mask.masked_fill_(~allowed, float("-inf"))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in on ``x``'s activations: autocast's (``--amp``) or ``x``'s own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def document_attention_mask(
    document_ids: torch.Tensor, causal: bool, dtype: torch.dtype, key_padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The batch's additive ``(B, 1, T, T)`` mask in ``dtype``: :func:`allowed_keys` of the documents,
    causality and ``key_padding_mask`` ``(B, T)``."""
    t = document_ids.size(1)
    return additive_mask(allowed_keys(t, t, causal, document_ids.device, key_padding_mask, document_ids), dtype)
