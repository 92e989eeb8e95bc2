"""The local experts as batched FFNs: ``(E_l, C, d) -> (E_l, C, d)`` with one ``bmm``
per projection (``fc2(act(fc1 x))``, Sub-LN before ``fc2`` under Magneto).

Expert parameters carry ``expert = True``, ``expert_group`` (the ranks holding other
experts, for the gradient norm) and ``expert_replica_group`` (the ranks holding a copy
of the same experts, for gradient averaging). Each expert is initialised from its own
generator seeded with ``base + global expert id`` (``base`` drawn from the global RNG),
so an expert gets the same initial weights whatever the number of ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchscale_fairseq.modules.feedforward import activate, check_activation


def mark_expert(param: torch.Tensor, expert_group: object | None, replica_group: object | None) -> None:
    param.expert = True
    param.expert_group = expert_group
    param.expert_replica_group = replica_group


class BatchedExperts(nn.Module):
    def __init__(
        self,
        num_local: int,
        first_expert: int,
        embed_dim: int,
        ffn_dim: int,
        activation: str = "gelu",
        activation_dropout: float = 0.0,
        subln: bool = False,
        gain: float = 1.0,
        layernorm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        check_activation(activation)
        self.activation = activation
        self.activation_dropout = activation_dropout
        self.layernorm_eps = layernorm_eps
        parts = 2 if activation == "swiglu" else 1
        self.fc1_weight = nn.Parameter(torch.empty(num_local, embed_dim, parts * ffn_dim))
        self.fc1_bias = nn.Parameter(torch.zeros(num_local, parts * ffn_dim))
        self.fc2_weight = nn.Parameter(torch.empty(num_local, ffn_dim, embed_dim))
        self.fc2_bias = nn.Parameter(torch.zeros(num_local, embed_dim))
        self.ln_weight = nn.Parameter(torch.ones(num_local, ffn_dim)) if subln else None
        self.ln_bias = nn.Parameter(torch.zeros(num_local, ffn_dim)) if subln else None
        base = int(torch.randint(0, 2**31 - 1, ()).item())
        std1 = gain * math.sqrt(2.0 / (embed_dim + ffn_dim))
        with torch.no_grad():
            for i in range(num_local):
                g = torch.Generator().manual_seed(base + first_expert + i)
                self.fc1_weight[i].copy_(torch.randn(embed_dim, parts * ffn_dim, generator=g) * std1)
                self.fc2_weight[i].copy_(torch.randn(ffn_dim, embed_dim, generator=g) * std1)

    def set_groups(self, expert_group: object | None, replica_group: object | None) -> None:
        for p in self.parameters():
            mark_expert(p, expert_group, replica_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (E_l, C, d)."""
        h = torch.baddbmm(self.fc1_bias.unsqueeze(1).to(x.dtype), x, self.fc1_weight.to(x.dtype))
        h = activate(h, self.activation)
        if self.activation_dropout > 0 and self.training:
            h = F.dropout(h, self.activation_dropout, training=True)
        if self.ln_weight is not None:
            h = F.layer_norm(h, h.shape[-1:], eps=self.layernorm_eps)
            h = h * self.ln_weight.unsqueeze(1).to(h.dtype) + self.ln_bias.unsqueeze(1).to(h.dtype)
        return torch.baddbmm(self.fc2_bias.unsqueeze(1).to(h.dtype), h, self.fc2_weight.to(h.dtype))
