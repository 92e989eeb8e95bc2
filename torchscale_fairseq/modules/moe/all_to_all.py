"""The one place tokens cross ranks: a differentiable ``all_to_all_single`` with
uneven split sizes (the backward pass is the same exchange with the splits swapped).

gloo implements ``all_to_all_single`` on CPU (checked with torch 2.13, even and uneven
splits), so no all_gather or send/recv fallback is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send,
                               input_split_sizes=ctx.recv, group=ctx.group)
        return out, None, None, None


def exchange(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Send ``send_splits[r]`` elements of flat ``x`` to rank ``r``; returns what arrives."""
    return _AllToAll.apply(x.reshape(-1), list(send_splits), list(recv_splits), group)


def all_gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``counts`` (rows per expert), stacked: ``(world, len(counts))``."""
    out = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, counts.contiguous(), group=group)
    return torch.stack(out)
