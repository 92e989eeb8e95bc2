"""xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer"): rotary position
embedding with an exponential decay, ``q_n * zeta^n`` and ``k_m * zeta^-m`` so that the
attention score depends on ``zeta^(n-m)``. Positions are absolute, so cached keys
stay valid in incremental decoding."""

from __future__ import annotations

import torch
import torch.nn as nn

from torchscale_fairseq.device_init import on_default_device


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class XPos(nn.Module):
    def __init__(self, head_dim: int, scale_base: float = 512.0) -> None:
        super().__init__()
        self.scale_base = scale_base
        # computed on the CPU: the same values whatever the default device
        zeta = (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") + 0.4 * head_dim) / (1.4 * head_dim)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim // 2, dtype=torch.float, device="cpu") / (head_dim // 2)))
        self.register_buffer("zeta", on_default_device(zeta), persistent=False)
        self.register_buffer("inv_freq", on_default_device(inv_freq), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0, downscale: bool = False) -> torch.Tensor:
        """Rotate ``x`` of shape ``(..., T, head_dim)`` for positions ``offset .. offset + T - 1``."""
        pos = torch.arange(offset, offset + x.size(-2), device=x.device, dtype=torch.float)
        scale = self.zeta[None, :] ** (pos[:, None] / self.scale_base)
        if downscale:
            scale = 1.0 / scale
        angles = pos[:, None] * self.inv_freq[None, :]
        sin = (torch.sin(angles) * scale).repeat_interleave(2, dim=-1).to(x.dtype)
        cos = (torch.cos(angles) * scale).repeat_interleave(2, dim=-1).to(x.dtype)
        return x * cos + _rotate_every_two(x) * sin
