"""Absolute positions as in fairseq: position ids start at ``padding_idx + 1`` and skip
padding, so left-padded sources get the same positions as unpadded ones. With
``--reset-positions-at-documents`` they restart at each document of a packed block
(:func:`document_positions`)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from torchscale_fairseq.device_init import cpu_construction, on_default_device


def make_positions(tokens: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """``padding_idx + 1 + (index among non-pad tokens)``, ``padding_idx`` on pads."""
    mask = tokens.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


def document_positions(tokens: torch.Tensor, document_ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """``padding_idx + 1 + (i - first index of i's document)``, ``padding_idx`` on pads (right padding)."""
    index = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
    starts = torch.ones_like(tokens, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return torch.where(tokens.eq(padding_idx), padding_idx, index - first + padding_idx + 1)


class LearnedPositionalEmbedding(nn.Embedding):
    """Learned table of ``max_positions`` positions (N(0, d^-1/2) init, pad row zero)."""

    def __init__(self, max_positions: int, embedding_dim: int, padding_idx: int) -> None:
        with cpu_construction(self):  # drawn on the CPU, then moved to the default device
            super().__init__(max_positions + padding_idx + 1, embedding_dim, padding_idx)
            self.max_positions = max_positions
            nn.init.normal_(self.weight, mean=0.0, std=embedding_dim**-0.5)
            nn.init.constant_(self.weight[padding_idx], 0.0)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """``positions``: ids from :func:`document_positions` (default :func:`make_positions`)."""
        return super().forward(make_positions(tokens, self.padding_idx) if positions is None else positions)


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed sin/cos table (Vaswani et al.), fairseq's layout: sines then cosines."""

    def __init__(self, embedding_dim: int, padding_idx: int, init_size: int = 1024) -> None:
        super().__init__()
        self.embedding_dim, self.padding_idx = embedding_dim, padding_idx
        self.max_positions = int(1e5)
        self.register_buffer("table", on_default_device(self.build(init_size, embedding_dim, padding_idx)),
                             persistent=False)

    @staticmethod
    def build(num_embeddings: int, embedding_dim: int, padding_idx: int) -> torch.Tensor:
        """The table, computed on the CPU (the same values whatever the default device)."""
        half = embedding_dim // 2
        freq = torch.exp(torch.arange(half, dtype=torch.float, device="cpu") * -(math.log(10000) / (half - 1)))
        angles = torch.arange(num_embeddings, dtype=torch.float, device="cpu").unsqueeze(1) * freq.unsqueeze(0)
        table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
        if embedding_dim % 2 == 1:
            table = torch.cat([table, torch.zeros(num_embeddings, 1, device="cpu")], dim=1)
        table[padding_idx, :] = 0
        return table

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: ids from :func:`document_positions` (default :func:`make_positions`)."""
        if positions is None:
            positions = make_positions(tokens, self.padding_idx)
        needed = self.padding_idx + 1 + tokens.size(1)  # bound on make_positions, no device sync
        if needed > self.table.size(0):
            self.table = self.build(needed, self.embedding_dim, self.padding_idx).to(self.table.device)
        return self.table[positions]
