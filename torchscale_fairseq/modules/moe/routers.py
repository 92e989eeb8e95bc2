"""Router scores ``(T, E)`` in fp32.

- :class:`XMoERouter` (X-MoE, Chi et al. 2022): ``s = cos(W_r x, e_k) / tau``, the token
  projected to a low dimension (16) and L2-normalised, expert embeddings ``e_k``
  L2-normalised, learnable temperature ``tau`` (init 0.07, clamped at 0.01).
  ``--moe-router torchscale_xmoe``: TorchScale 0.3.0's gate (``Top1Gate`` / ``Top2Gate`` with
  ``use_xmoe``), ``s = (W_r x) . e_k / |e_k|``: no token normalisation, no temperature, and
  ``e_k`` rescaled to norm 1.5 in place before each training forward.
- :class:`LinearRouter` (GShard/Switch): ``s = W_g x``; with ``noise > 0`` noisy top-k
  (Shazeer et al. 2017): ``H = W_g x + eps * softplus(W_n x)``, ``eps ~ N(0, noise^2)``
  in training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchscale_fairseq.device_init import cpu_construction


class XMoERouter(nn.Module):
    TORCHSCALE_EXPERT_NORM = 1.5  # torchscale/component/xmoe/routing.py: self.wg.mul_(1.5 / wg_norm)

    def __init__(self, embed_dim: int, num_experts: int, router_dim: int = 16, init_temperature: float = 0.07,
                 torchscale_gate: bool = False) -> None:
        super().__init__()
        with cpu_construction(self):  # drawn on the CPU, then moved to the default device
            self.proj = nn.Linear(embed_dim, router_dim, bias=False)
            nn.init.xavier_normal_(self.proj.weight)
            self.expert_embeddings = nn.Parameter(torch.empty(num_experts, router_dim))
            nn.init.orthogonal_(self.expert_embeddings, gain=0.32)
            self.log_temperature = (None if torchscale_gate
                                    else nn.Parameter(torch.tensor(float(init_temperature)).log()))
        self.min_temperature = 0.01

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            tokens = F.linear(x.float(), self.proj.weight.float())
            if self.log_temperature is None:  # TorchScale 0.3.0's use_xmoe gate
                if self.training:
                    with torch.no_grad():
                        norm = self.expert_embeddings.norm(p=2.0, dim=1, keepdim=True)
                        self.expert_embeddings.mul_(self.TORCHSCALE_EXPERT_NORM / norm)
                experts = F.normalize(self.expert_embeddings.float(), p=2.0, dim=-1, eps=1e-4)
                return tokens @ experts.t()
            tokens = F.normalize(tokens, p=2.0, dim=-1, eps=1e-4)
            experts = F.normalize(self.expert_embeddings.float(), p=2.0, dim=-1, eps=1e-4)
            tau = self.log_temperature.float().exp().clamp(min=self.min_temperature)
            return tokens @ experts.t() / tau


class LinearRouter(nn.Module):
    def __init__(self, embed_dim: int, num_experts: int, noise: float = 0.0) -> None:
        super().__init__()
        self.noise = noise
        self.noise_proj = None
        with cpu_construction(self):  # drawn on the CPU, then moved to the default device
            self.gate = nn.Linear(embed_dim, num_experts, bias=False)
            nn.init.xavier_normal_(self.gate.weight)
            if noise > 0:
                self.noise_proj = nn.Linear(embed_dim, num_experts, bias=False)
                nn.init.zeros_(self.noise_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.float()
            logits = F.linear(x, self.gate.weight.float())
            if self.noise_proj is not None and self.training:
                std = F.softplus(F.linear(x, self.noise_proj.weight.float()))
                logits = logits + torch.randn_like(logits) * self.noise * std
            return logits


def build_router(kind: str, embed_dim: int, num_experts: int, router_dim: int, noise: float) -> nn.Module:
    """``xmoe`` and ``torchscale_xmoe`` use :class:`XMoERouter`; ``linear`` and ``expert_choice`` a linear gate."""
    if kind in ("xmoe", "torchscale_xmoe"):
        return XMoERouter(embed_dim, num_experts, router_dim, torchscale_gate=kind == "torchscale_xmoe")
    return LinearRouter(embed_dim, num_experts, noise)
