"""Position-wise feed-forward network, Megatron-split: ``fc1`` column-parallel (each rank
applies the activation to its slice), ``fc2`` row-parallel, one all-reduce after ``fc2``.
Magneto (Sub-LN) puts a LayerNorm on the activation before ``fc2``. ``swiglu`` uses a
fused gate/up ``fc1`` (stride 2): ``silu(x W_g) * (x W_u)``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.layers import (
    ColumnParallelLinear,
    ParallelLayerNorm,
    RowParallelLinear,
    TensorParallelGroup,
)
from torchscale_fairseq.model_parallel.random import get_rng_tracker
from torchscale_fairseq.modules.multihead_attention import scaled_xavier_blocks

ACTIVATIONS = ("gelu", "relu", "swiglu")


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise TsConfigError(f"--activation-fn {name!r} is not supported by ts models: choose one of {', '.join(ACTIVATIONS)}")


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``gelu``/``relu`` elementwise; ``swiglu`` on the fused ``[gate, up]`` halves."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h) if activation == "gelu" else F.relu(h)


@dataclass(frozen=True)
class FFNSpec:
    """One FFN ``fc2(act(fc1 x))`` of width ``embed_dim -> ffn_dim -> embed_dim``: its activation,
    the dropout on the activation, Magneto's Sub-LN before ``fc2`` (``subln``, epsilon
    ``layernorm_eps``) and the init gain of both projections (Magneto / DeepNorm). Taken by the
    dense FFN, the experts (:class:`~torchscale_fairseq.modules.moe.experts.GroupedExperts`) and
    the MoE layer."""

    embed_dim: int
    ffn_dim: int
    activation: str = "gelu"
    activation_dropout: float = 0.0
    subln: bool = False
    gain: float = 1.0
    layernorm_eps: float = 1e-5


class FeedForwardNetwork(nn.Module):
    def __init__(self, spec: FFNSpec, *, tp_group: TensorParallelGroup = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        check_activation(spec.activation)
        self.activation = spec.activation
        self.activation_dropout = spec.activation_dropout
        parts = 2 if spec.activation == "swiglu" else 1
        self.fc1 = ColumnParallelLinear(
            spec.embed_dim, parts * spec.ffn_dim, stride=parts,
            init_method=scaled_xavier_blocks(parts, {i: spec.gain for i in range(parts)}), what="FFN dimension",
            tp_group=tp_group, sequence_parallel=sequence_parallel,
        )
        self.ffn_layernorm = (ParallelLayerNorm(spec.ffn_dim, eps=spec.layernorm_eps, tp_group=tp_group)
                              if spec.subln else None)
        self.fc2 = RowParallelLinear(spec.ffn_dim, spec.embed_dim, init_method=scaled_xavier_blocks(1, {0: spec.gain}),
                                     what="FFN dimension", tp_group=tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = activate(h, self.activation)
        if self.activation_dropout > 0 and self.training:
            with get_rng_tracker().fork():
                h = F.dropout(h, self.activation_dropout, training=True)
        if self.ffn_layernorm is not None:
            h = self.ffn_layernorm(h)
        return self.fc2(h)
