"""One transformer layer (self-attention, optional cross-attention, FFN) under any backbone:
Pre-LN/Magneto ``x + f(LN(x))``, Post-LN ``LN(x + f(x))``, DeepNorm ``LN(alpha x + f(x))``.

The forward returns the output and the MoE layer's
:class:`~torchscale_fairseq.modules.moe.balance.MoEAux` (``None`` for a dense FFN). A layer
built with ``checkpoint_activations`` recomputes its activations in backward
(non-reentrant ``torch.utils.checkpoint``; the tensor-parallel RNG streams are replayed so
dropout draws the same masks, the router the same noise and second experts) when training
without a decoding cache; an MoE FFN gets a
:class:`~torchscale_fairseq.modules.moe.layer.RecomputeMemo` per call, so that its
recomputation repeats no routing statistics and no collective but its two all-to-alls
(none with ``--moe-checkpoint-exchange keep``)."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.model_parallel.attributes import mark_sequence_parallel
from torchscale_fairseq.model_parallel.random import checkpoint_context, get_rng_tracker
from torchscale_fairseq.modules.feedforward import FeedForwardNetwork
from torchscale_fairseq.modules.moe.balance import MoEAux
from torchscale_fairseq.modules.moe.layer import MoELayer, RecomputeMemo
from torchscale_fairseq.modules.multihead_attention import IncrementalState, MultiheadAttention


class _AddMasked(torch.autograd.Function):
    """``residual + y * mask`` in one pass; backward ``(grad, grad * mask)``."""

    @staticmethod
    def forward(ctx, residual: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mask)
        return torch.addcmul(residual, y, mask)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return grad, grad * mask, None


def dropout_add(residual: torch.Tensor, y: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``residual + F.dropout(y, p, training)``. On CPU in training with ``0 < p < 1`` the
    noise is the one ``F.dropout`` draws there (``bernoulli_(1 - p) / (1 - p)``, same
    generator calls, kept as a float tensor for backward as ``F.dropout`` on CPU keeps it),
    applied and added in one pass instead of a multiply and an add. Other devices use
    ``F.dropout``, whose fused kernel keeps a 1-byte mask."""
    if (not training or not 0.0 < p < 1.0 or y.device.type != "cpu" or residual.shape != y.shape
            or residual.dtype != y.dtype):
        return residual + F.dropout(y, p, training)
    mask = torch.empty_like(y).bernoulli_(1.0 - p).div_(1.0 - p)
    return _AddMasked.apply(residual, y, mask)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: StackConfig, cross_attention: bool = False, ffn: Optional[nn.Module] = None) -> None:
        super().__init__()
        b = cfg.backbone
        self.normalize_before = b.normalize_before
        self.alpha = b.alpha
        self.dropout = cfg.dropout
        attn_kwargs = dict(dropout=cfg.attention_dropout, subln=b.subln, gain=b.gain, layernorm_eps=cfg.layernorm_eps,
                           tp_group=cfg.tp_group, sequence_parallel=cfg.sequence_parallel,
                           recompute_core=cfg.selective_recompute, backend=cfg.attention_backend,
                           context_parallel=cfg.context_parallel)
        self.self_attn = MultiheadAttention(cfg.embed_dim, cfg.attention_heads, xpos=cfg.xpos, **attn_kwargs)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.layernorm_eps)
        self.cross_attn = None
        if cross_attention:
            self.cross_attn = MultiheadAttention(cfg.embed_dim, cfg.attention_heads, self_attention=False, **attn_kwargs)
            self.cross_attn_layer_norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.layernorm_eps)
        self.ffn = ffn if ffn is not None else FeedForwardNetwork(
            cfg.ffn_spec(), tp_group=cfg.tp_group, sequence_parallel=cfg.sequence_parallel)
        self.final_layer_norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.layernorm_eps)
        self.checkpoint_activations = cfg.checkpoint_activations
        self.compiled = False  # wrap_layer
        self.sequence_parallel = cfg.sequence_parallel
        if cfg.sequence_parallel:
            norms = [self.self_attn_layer_norm, self.final_layer_norm]
            norms += [self.cross_attn_layer_norm] if cross_attention else []
            mark_sequence_parallel(p for norm in norms for p in norm.parameters())

    def _sublayer(self, x: torch.Tensor, norm: nn.Module, fn) -> torch.Tensor:
        if self.normalize_before:
            return self._dropout_add(x, fn(norm(x)))
        residual = x * self.alpha if self.alpha != 1.0 else x
        return norm(self._dropout_add(residual, fn(x)))

    def _dropout_add(self, residual: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Residual dropout; on a slice of the sequence each rank draws its own masks
        (the tensor-parallel RNG stream), as each rank owns different positions."""
        if self.sequence_parallel and self.training:
            with get_rng_tracker().fork():
                return dropout_add(residual, y, self.dropout, self.training)
        return dropout_add(residual, y, self.dropout, self.training)

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        self_attn_bias: Optional[torch.Tensor] = None,
        memory: Optional[torch.Tensor] = None,
        memory_padding_mask: Optional[torch.Tensor] = None,
        incremental_state: Optional[IncrementalState] = None,
        offset: int = 0,
        self_attn_mask: Optional[torch.Tensor] = None,
        ring_document_ids: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[MoEAux]]:
        """``self_attn_mask``: the batch's additive ``(B, 1, T, T)`` self-attention mask, causality and
        padding included (document masks, :mod:`~torchscale_fairseq.modules.document_mask`);
        ``ring_document_ids``: under context parallelism the whole sequence's document ids instead."""
        if self.checkpoint_activations and self.training and incremental_state is None:
            memo = RecomputeMemo() if isinstance(self.ffn, MoELayer) else None
            return checkpoint(self._forward, x, padding_mask, causal, self_attn_bias, memory, memory_padding_mask,
                              None, 0, memo, self_attn_mask, ring_document_ids, use_reentrant=False,
                              context_fn=checkpoint_context)
        # decoding runs eager: its KV-cache dict changes every step (a recompile per step and layer)
        if not self.compiled or incremental_state is not None:
            return self._forward(x, padding_mask, causal, self_attn_bias, memory, memory_padding_mask,
                                 incremental_state, offset, None, self_attn_mask, ring_document_ids)
        x, aux = _compiled_forward()(self, x, padding_mask, causal, self_attn_bias, memory, memory_padding_mask,
                                     None, offset, None, self_attn_mask, ring_document_ids)
        if aux is not None:  # named here: the layer's tag read inside the graph would recompile it per layer
            aux.tag = self.ffn.tag
        return x, aux

    def _forward(
        self,
        x: torch.Tensor,
        padding_mask: Optional[torch.Tensor],
        causal: bool,
        self_attn_bias: Optional[torch.Tensor],
        memory: Optional[torch.Tensor],
        memory_padding_mask: Optional[torch.Tensor],
        incremental_state: Optional[IncrementalState] = None,
        offset: int = 0,
        moe_memo: Optional[RecomputeMemo] = None,
        self_attn_mask: Optional[torch.Tensor] = None,
        ring_document_ids: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[MoEAux]]:
        x = self._sublayer(x, self.self_attn_layer_norm, lambda h: self.self_attn(
            h, key_padding_mask=padding_mask, causal=causal, bias=self_attn_bias,
            incremental_state=incremental_state, offset=offset, attn_mask=self_attn_mask,
            ring_document_ids=ring_document_ids,
        ))
        if self.cross_attn is not None:
            x = self._sublayer(x, self.cross_attn_layer_norm, lambda h: self.cross_attn(
                h, memory=memory, key_padding_mask=memory_padding_mask, incremental_state=incremental_state,
            ))
        if not isinstance(self.ffn, MoELayer):
            return self._sublayer(x, self.final_layer_norm, self.ffn), None
        aux: list[MoEAux] = []

        def moe(h: torch.Tensor) -> torch.Tensor:
            y, layer_aux = self.ffn(h, padding_mask, incremental_state is not None, moe_memo)
            aux.append(layer_aux)
            return y

        return self._sublayer(x, self.final_layer_norm, moe), aux[0]


def wrap_layer(layer: nn.Module, cfg: StackConfig) -> nn.Module:
    """The layer as its stack runs it: with ``cfg.compile_layers`` (``--ts-compile``) its
    training and scoring forward runs through one ``torch.compile`` of ``TransformerLayer._forward``
    (regional compilation: one graph shared by the layers of the same shape, so compile time does not
    grow with depth; incremental decoding stays eager, its cache changes every step). Parameter
    names and checkpoints are those of the eager layer."""
    if cfg.compile_layers:
        layer.compiled = True
    return layer


# Cache entries of the one compiled function: each kind of layer (dense or MoE FFN, encoder or decoder)
# in training and in validation, with static and then dynamic lengths: more than dynamo's default 8 for
# an MoE translation model (benchmarks/compile_entries.py), past which a new entry's layers would run eager.
COMPILED_LAYER_ENTRIES = 64


@functools.cache
def _compiled_forward():
    """``TransformerLayer._forward`` compiled once for all layers (``self`` is an argument)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_LAYER_ENTRIES)
    return torch.compile(TransformerLayer._forward)
