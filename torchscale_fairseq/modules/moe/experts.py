"""The local experts as batched FFNs: ``(E_l, C, d) -> (E_l, C, d)`` with one ``bmm``
per projection (``fc2(act(fc1 x))``, Sub-LN before ``fc2`` under Magneto).

Each projection ``y = b + x W`` (``W``: ``(E_l, d_in, d_out)``) is a
:class:`BatchedLinear` with backward ``dx = dy W^T``, ``dW = x^T dy``, ``db = sum_C dy``.
``dW`` is as large as the expert weights (2 GB per step for 256 experts of 512 x 2048)
and fairseq sets gradients to ``None`` every step, so without care it is a fresh
allocation each step, and on CPU the first-touch page faults of that memory cost more
than the GEMM that fills it (1.4-1.8 s per GB on the benchmark box, vs 1.1 s for the
GEMM). :class:`GradBuffers` keeps the storage of the last weight gradient and hands it
out again once nothing else references it (its storage use count is back to 1), so the
gradient still reaches ``.grad`` through autograd (hooks, accumulation and
``torch.autograd.grad`` behave as for any parameter) but the memory stays mapped.

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
from torch.autograd.function import once_differentiable

from torchscale_fairseq.modules.feedforward import activate, check_activation


class GradBuffers:
    """One reusable gradient storage per weight name (see the module docstring)."""

    def __init__(self) -> None:
        self.storages: dict[str, torch.UntypedStorage] = {}

    def empty(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor shaped like ``like``, on the cached storage when it is free."""
        storage = self.storages.get(name)
        if (storage is None or storage.device != like.device or storage.nbytes() != like.nbytes
                or torch._C._storage_Use_Count(storage._cdata) > 1):
            out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            self.storages[name] = out.untyped_storage()
            return out
        return torch.empty(0, dtype=like.dtype, device=like.device).set_(storage, 0, like.shape)

    def __getstate__(self) -> dict:
        """A cache: copies and pickles start empty."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.storages = {}


class BatchedLinear(torch.autograd.Function):
    """``y = b + x W`` per expert: ``x`` (E, C, d_in), ``W`` (E, d_in, d_out), ``b`` (E, d_out)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, buffers: GradBuffers,
                name: str) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.buffers, ctx.name = buffers, name
        return torch.baddbmm(bias.unsqueeze(1), x, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        dx = torch.bmm(grad, weight.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(x.transpose(1, 2), grad, out=ctx.buffers.empty(ctx.name, weight))
        db = grad.sum(1) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


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
        self.grad_buffers = GradBuffers()
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
        h = BatchedLinear.apply(x, self.fc1_weight.to(x.dtype), self.fc1_bias.to(x.dtype), self.grad_buffers, "fc1")
        h = activate(h, self.activation)
        if self.activation_dropout > 0 and self.training:
            h = F.dropout(h, self.activation_dropout, training=True)
        if self.ln_weight is not None:
            h = F.layer_norm(h, h.shape[-1:], eps=self.layernorm_eps)
            h = h * self.ln_weight.unsqueeze(1).to(h.dtype) + self.ln_bias.unsqueeze(1).to(h.dtype)
        return BatchedLinear.apply(h, self.fc2_weight.to(h.dtype), self.fc2_bias.to(h.dtype), self.grad_buffers, "fc2")
