"""The local experts as batched FFNs: ``(E_l, C, d) -> (E_l, C, d)`` with one ``bmm``
per projection (``fc2(act(fc1 x))``, Sub-LN before ``fc2`` under Magneto).

Each projection ``y = b + x W`` (``W``: ``(E_l, d_in, d_out)``) is a
:class:`BatchedLinear` whose backward is ``dx = dy W^T``, ``dW = x^T dy``,
``db = sum_C dy``. ``dW`` is as large as the expert weights (2 GB per step at 256
experts of 512 x 2048), and fairseq clears gradients to ``None`` every step, so it is
a fresh allocation each time; on Linux it is asked for in transparent huge pages
(``madvise(MADV_HUGEPAGE)``), which makes first-touch page faults of that memory about
5x cheaper (measured 1.8 s -> 0.3 s per GB on the benchmark box). The gradient still
reaches ``.grad`` through autograd (hooks, accumulation and ``torch.autograd.grad``
behave as for any parameter).

Expert parameters carry ``expert = True``, ``expert_group`` (the ranks holding other
experts, for the gradient norm) and ``expert_replica_group`` (the ranks holding a copy
of the same experts, for gradient averaging). Each expert is initialised from its own
generator seeded with ``base + global expert id`` (``base`` drawn from the global RNG),
so an expert gets the same initial weights whatever the number of ranks.
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from torchscale_fairseq.modules.feedforward import activate, check_activation


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def empty_huge(shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
    """``torch.empty`` of a large CPU buffer, its 2 MB-aligned interior advised as huge pages."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    if _LIBC is not None and out.device.type == "cpu" and out.nbytes >= 2 * HUGE_PAGE:
        start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (out.data_ptr() + out.nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
    return out


class BatchedLinear(torch.autograd.Function):
    """``y = b + x W`` per expert: ``x`` (E, C, d_in), ``W`` (E, d_in, d_out), ``b`` (E, d_out)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.baddbmm(bias.unsqueeze(1), x, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        dx = torch.bmm(grad, weight.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        dw = torch.bmm(x.transpose(1, 2), grad, out=empty_huge(weight.shape, weight)) \
            if ctx.needs_input_grad[1] else None
        db = grad.sum(1) if ctx.needs_input_grad[2] else None
        return dx, dw, db


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
        h = BatchedLinear.apply(x, self.fc1_weight.to(x.dtype), self.fc1_bias.to(x.dtype))
        h = activate(h, self.activation)
        if self.activation_dropout > 0 and self.training:
            h = F.dropout(h, self.activation_dropout, training=True)
        if self.ln_weight is not None:
            h = F.layer_norm(h, h.shape[-1:], eps=self.layernorm_eps)
            h = h * self.ln_weight.unsqueeze(1).to(h.dtype) + self.ln_bias.unsqueeze(1).to(h.dtype)
        return BatchedLinear.apply(h, self.fc2_weight.to(h.dtype), self.fc2_bias.to(h.dtype))
