"""Input embedding of a stack: ``scale * E[tokens] + P[positions]``, optional LayerNorm,
dropout. The token table is vocabulary-parallel (plain at tensor-parallel size 1)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.sequence_parallel import is_split, split_sequence
from torchscale_fairseq.model_parallel.attributes import mark_sequence_parallel
from torchscale_fairseq.model_parallel.layers import TensorParallelGroup, VocabParallelEmbedding
from torchscale_fairseq.model_parallel.random import get_rng_tracker
from torchscale_fairseq.modules.positions import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEmbedding,
    document_positions,
)


def build_token_embedding(num_embeddings: int, embed_dim: int, padding_idx: int,
                          tp_group: TensorParallelGroup = None) -> VocabParallelEmbedding:
    return VocabParallelEmbedding(num_embeddings, embed_dim, padding_idx, tp_group)


class InputEmbedding(nn.Module):
    def __init__(self, cfg: StackConfig, embed_tokens: VocabParallelEmbedding, padding_idx: int) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.padding_idx = padding_idx
        self.scale = math.sqrt(cfg.embed_dim) if cfg.scale_embedding else 1.0
        self.dropout = cfg.dropout
        self.max_positions = cfg.max_positions
        self.embed_positions: Optional[nn.Module] = None
        if cfg.positions == "learned":
            self.embed_positions = LearnedPositionalEmbedding(cfg.max_positions, cfg.embed_dim, padding_idx)
        elif cfg.positions == "sinusoidal":
            self.embed_positions = SinusoidalPositionalEmbedding(cfg.embed_dim, padding_idx, cfg.max_positions + padding_idx + 1)
        self.layernorm_embedding = nn.LayerNorm(cfg.embed_dim, eps=cfg.layernorm_eps) if cfg.layernorm_embedding else None
        self.cfg = cfg
        if cfg.sequence_parallel and self.layernorm_embedding is not None:
            mark_sequence_parallel(self.layernorm_embedding.parameters())

    def forward(self, tokens: torch.Tensor, last_only: bool = False,
                document_ids: Optional[torch.Tensor] = None,
                context_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Embed ``tokens`` (B, T); with ``last_only`` only the last position (decoding); with
        ``context_index`` (context parallelism) only those positions of the whole sequence, their
        positions computed on the whole sequence. Under sequence parallelism (training) the result
        is this rank's slice of the sequence, and its dropout masks are this rank's own. With
        ``document_ids`` (B, T) and ``cfg.reset_positions`` positions restart at each document
        (:func:`document_positions`)."""
        positions = None
        if self.embed_positions is not None:
            ids = (document_positions(tokens, document_ids, self.padding_idx)
                   if document_ids is not None and self.cfg.reset_positions else None)
            positions = self.embed_positions(tokens, ids)
        if last_only:
            tokens = tokens[:, -1:]
            positions = positions[:, -1:] if positions is not None else None
        if context_index is not None:
            tokens = tokens[:, context_index]
            positions = positions[:, context_index] if positions is not None else None
        x = self.embed_tokens(tokens) * self.scale
        if positions is not None:
            x = x + positions.to(x.dtype)
        if not is_split(self.cfg, self.training):
            if self.layernorm_embedding is not None:
                x = self.layernorm_embedding(x)
            return F.dropout(x, self.dropout, self.training)
        x = split_sequence(x, self.cfg)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        with get_rng_tracker().fork():
            return F.dropout(x, self.dropout, self.training)
