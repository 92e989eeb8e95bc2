"""Transformer encoder (bidirectional). Output is batch-first: ``encoder_out`` (B, S, C);
``moe`` holds the MoE layers' :class:`~torchscale_fairseq.modules.moe.balance.MoEAux`.

Under pipeline parallelism (``ts_mlm``) a rank holds its stages' layers (``cfg.split``), the first
stage the embedding, the last the final LayerNorm
(:class:`~torchscale_fairseq.architecture.pipeline_stage.PipelineStage`); a stage before the last
returns its chunk's output hidden states as ``encoder_out``."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn
from fairseq.models import FairseqEncoder

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.embedding import InputEmbedding
from torchscale_fairseq.architecture.layer import TransformerLayer, wrap_layer
from torchscale_fairseq.architecture.padding_layout import NONE, after_padding, known_padding_layout, mark_padding_layout
from torchscale_fairseq.architecture.pipeline_stage import PipelineStage
from torchscale_fairseq.architecture.sequence_parallel import (
    gather_sequence,
    is_split,
    pad_document_ids,
    pad_tokens,
    sequence_slice,
)
from torchscale_fairseq.model_parallel.attributes import mark_sequence_parallel
from torchscale_fairseq.modules.document_mask import compute_dtype, document_attention_mask
from torchscale_fairseq.modules.moe.factory import build_ffn
from torchscale_fairseq.modules.relative_position_bias import RelativePositionBias


class TransformerEncoder(FairseqEncoder, PipelineStage):
    def __init__(self, cfg: StackConfig, dictionary, embed_tokens: nn.Module) -> None:
        super().__init__(dictionary)
        self.cfg = cfg
        self.padding_idx = dictionary.pad()
        embed = InputEmbedding(cfg, embed_tokens, self.padding_idx)  # (drawn first, as in one process)
        self.embed = embed if cfg.split.holds_first_stage else None
        self.layers = self.init_stage(cfg, lambda i: wrap_layer(TransformerLayer(cfg, ffn=build_ffn(cfg, i, f"enc{i}")),
                                                                 cfg))
        self.layer_norm = (nn.LayerNorm(cfg.embed_dim, eps=cfg.layernorm_eps)
                           if cfg.backbone.normalize_before and self.split.holds_last_stage else None)
        if cfg.sequence_parallel and self.layer_norm is not None:
            mark_sequence_parallel(self.layer_norm.parameters())
        self.rel_pos = (
            RelativePositionBias(cfg.attention_heads, True, cfg.rel_pos_buckets, cfg.max_rel_pos, cfg.tp_group)
            if cfg.rel_pos_buckets > 0 else None
        )

    def forward(
        self,
        src_tokens: torch.Tensor,
        src_lengths: Optional[torch.Tensor] = None,
        return_all_hiddens: bool = False,
        pipeline_chunk: int = 0,
        pipeline_input: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
        **unused,
    ) -> Dict[str, List]:
        """``pipeline_chunk``: which of this rank's chunks runs, on ``pipeline_input`` (the previous
        stage's hidden states; ``None`` on the first stage, which embeds the tokens).
        ``document_ids`` (B, T): the documents of packed blocks; attention stays within each
        (:mod:`~torchscale_fairseq.modules.document_mask`)."""
        chunk = pipeline_chunk
        length = src_tokens.size(1)
        split = is_split(self.cfg, self.training)
        tokens = pad_tokens(src_tokens, self.cfg, self.padding_idx) if split else src_tokens
        if split and document_ids is not None:
            document_ids = pad_document_ids(document_ids, self.cfg)
        padding_mask = tokens.eq(self.padding_idx)
        given = known_padding_layout(src_tokens)  # found on the host (padding_layout.py), else tested here
        layout = after_padding(given, tokens.size(1) != length)
        has_pad = layout != NONE if layout is not None else bool(padding_mask.any())
        if self.split.is_first(chunk):
            x = self.embed(tokens, document_ids=document_ids)
            if has_pad:
                x = x.masked_fill((sequence_slice(padding_mask, self.cfg) if split else padding_mask).unsqueeze(-1), 0.0)
        else:
            x = pipeline_input
        bias = self.rel_pos(tokens.size(1), tokens.size(1)) if self.rel_pos is not None else None
        mask = padding_mask if has_pad else None
        attn_mask = (document_attention_mask(document_ids, False, compute_dtype(x), mask)
                     if document_ids is not None else None)
        states = [x] if return_all_hiddens else []
        moe = []
        layers = self.chunk_layers(chunk)
        self.log_attention_kernel(layers, x, causal=False)
        for layer in layers:
            x, aux = layer(x, padding_mask=mask, self_attn_bias=bias, self_attn_mask=attn_mask)
            if aux is not None:
                moe.append(aux)
            if return_all_hiddens:
                states.append(x)
        if self.split.is_last(chunk):
            if self.layer_norm is not None:
                x = self.layer_norm(x)
            if split:
                x, padding_mask = gather_sequence(x, self.cfg, length), padding_mask[:, :length]
        if given is not None:  # the decoder's memory mask: no second test
            mark_padding_layout(padding_mask, after_padding(given, padding_mask.size(1) != length))
        return {
            "encoder_out": [x],
            "encoder_padding_mask": [padding_mask],
            "encoder_states": states,
            "src_tokens": [],
            "src_lengths": [src_lengths] if src_lengths is not None else [],
            "moe": moe,
        }

    def reorder_encoder_out(self, encoder_out: Dict[str, List], new_order: torch.Tensor) -> Dict[str, List]:
        return {
            key: [t.index_select(0, new_order) if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in value]
            for key, value in encoder_out.items()
        }

    def max_positions(self) -> int:
        return self.cfg.max_positions
