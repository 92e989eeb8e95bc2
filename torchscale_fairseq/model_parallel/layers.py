"""Megatron-LM's parallel layers (paper section 3): column/row-parallel linear layers,
the vocabulary-parallel embedding and a LayerNorm over sharded features.

Each layer is given its tensor-parallel ``tp_group`` (``None``: a group of one), initialises
the *full* weight with the caller's ``init_method`` and keeps its own shard, so the same
seed gives the same full model for every tensor-parallel size N. At N = 1 every layer is
exactly its dense counterpart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchscale_fairseq.device_init import on_default_device
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import mark_sequence_parallel, mark_sharded, mark_vocab_padded
from torchscale_fairseq.model_parallel.mappings import (
    all_gather_sequence,
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_parallel_region,
    sum_over_group,
)
from torchscale_fairseq.model_parallel.partition import padded_vocab_size, shard_tensor
from torchscale_fairseq.model_parallel.process_groups import group_rank, group_size

TensorParallelGroup = dist.ProcessGroup | None

InitMethod = Callable[[torch.Tensor], None]
Gemm = Callable[..., torch.Tensor]  # (x, weight, bias=None) -> x weight^T + bias, as F.linear


def xavier_normal_init(weight: torch.Tensor) -> None:
    nn.init.xavier_normal_(weight)


def real_rows_normal_init(rows: int, std: float) -> InitMethod:
    """``N(0, std^2)`` for the first ``rows`` rows (the real vocabulary), zero for the
    padded rest: the RNG draws and the real rows do not depend on the padding."""

    def init(weight: torch.Tensor) -> None:
        nn.init.normal_(weight[:rows], mean=0.0, std=std)
        nn.init.zeros_(weight[rows:])

    return init


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, or a one-line error naming ``what``."""
    if numerator % denominator != 0:
        raise TsConfigError(
            f"{what} ({numerator}) is not divisible by --model-parallel-size {denominator}: "
            f"choose a {what} that is a multiple of {denominator}"
        )
    return numerator // denominator


def _sharded_parameter(full: torch.Tensor, dim: int, stride: int, group: TensorParallelGroup) -> nn.Parameter:
    """This rank's shard of ``full`` (made on the CPU) as a parameter on the default device."""
    n, rank = group_size(group), group_rank(group)
    return mark_sharded(nn.Parameter(on_default_device(shard_tensor(full, dim, stride, rank, n))), dim, stride)


class _SequenceParallelLinear(torch.autograd.Function):
    """``Y = all_gather(X_r) A + b`` keeping only this rank's ``X_r`` for backward, which
    gathers it again for ``dA`` and reduce-scatters ``dX`` (Megatron-LM's sequence-parallel
    column-parallel linear): the saved input is ``1/t`` of the gathered one."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(all_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = all_gather_sequence(x, ctx.group)
        grad_x = reduce_scatter_sequence(grad.matmul(weight), ctx.group)
        grad_weight = grad.flatten(0, -2).t().matmul(full.flatten(0, -2))
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns (output features); output stays sharded
    unless ``gather_output``. ``stride`` > 1 keeps fused blocks (Q/K/V) whole per rank.
    With ``sequence_parallel``, a training input is this rank's slice of the sequence and
    is all-gathered first (reduce-scattered gradient) instead of ``f``
    (:class:`_SequenceParallelLinear`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        init_method: InitMethod = xavier_normal_init,
        what: str = "output size",
        tp_group: TensorParallelGroup = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        divide(out_features // stride, group_size(tp_group), what)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.stride = gather_output, stride
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        full = torch.empty(out_features, in_features, device="cpu")  # drawn on the CPU: device_init.py
        init_method(full)
        self.weight = _sharded_parameter(full, 0, stride, tp_group)
        self.bias = _sharded_parameter(torch.zeros(out_features), 0, stride, tp_group) if bias else None
        self.gemm: Gemm = F.linear  # the local x W_r^T + b; FP8: float8.convert_to_fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.training and group_size(self.tp_group) > 1:
            y = _SequenceParallelLinear.apply(x, self.weight, self.bias, self.tp_group)
        else:
            y = self.gemm(copy_to_tensor_parallel_region(x, self.tp_group), self.weight, self.bias)
        n = group_size(self.tp_group)
        if not self.gather_output or n == 1:
            return y
        y = gather_from_tensor_parallel_region(y, self.tp_group)
        if self.stride > 1:
            # ranks' [block_0 .. block_{k-1}] slices -> [block_0 of all ranks, ...]
            y = y.unflatten(-1, (n, self.stride, -1)).transpose(-3, -2).flatten(-3)
        return y


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows (input features); the partial products are
    all-reduced and the (replicated) bias is added once, after the all-reduce. With
    ``sequence_parallel`` a training output is reduce-scattered along the sequence instead
    (the bias then sees this rank's slice only: its gradient is marked for the
    tensor-parallel sum)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method: InitMethod = xavier_normal_init,
        what: str = "input size",
        tp_group: TensorParallelGroup = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        divide(in_features, group_size(tp_group), what)
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        full = torch.empty(out_features, in_features, device="cpu")  # drawn on the CPU: device_init.py
        init_method(full)
        self.weight = _sharded_parameter(full, 1, 1, tp_group)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if sequence_parallel and bias:
            mark_sequence_parallel([self.bias])
        self.gemm: Gemm = F.linear  # the local x W_r^T; FP8: float8.convert_to_fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(x, self.weight)
        if self.sequence_parallel and self.training:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding split along the vocabulary; each rank looks up its own ids and the
    partial embeddings are all-reduced. Padded rows are zero and never used."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 tp_group: TensorParallelGroup = None) -> None:
        super().__init__()
        n, rank = group_size(tp_group), group_rank(tp_group)
        self.tp_group = tp_group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.padded_num_embeddings = padded_vocab_size(num_embeddings, n)
        self.shard_size = self.padded_num_embeddings // n
        self.vocab_start = rank * self.shard_size
        full = torch.zeros(self.padded_num_embeddings, embedding_dim, device="cpu")
        nn.init.normal_(full[:num_embeddings], mean=0.0, std=embedding_dim**-0.5)
        if padding_idx is not None:
            full[padding_idx].zero_()
        self.weight = mark_vocab_padded(_sharded_parameter(full, 0, 1, tp_group), num_embeddings)
        local_pad = None
        if padding_idx is not None and 0 <= padding_idx - self.vocab_start < self.shard_size:
            local_pad = padding_idx - self.vocab_start
        self.local_padding_idx = local_pad

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(tokens, self.weight, self.padding_idx)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.tp_group)


def parallel_logits(x: torch.Tensor, weight: torch.Tensor, tp_group: TensorParallelGroup) -> torch.Tensor:
    """This rank's vocabulary slice of the output logits, ``x W_r^T`` (``f`` before it)."""
    return F.linear(copy_to_tensor_parallel_region(x, tp_group), weight)


class _ShardedLayerNorm(torch.autograd.Function):
    """LayerNorm of a tensor whose features are split over ``group``: moments over all
    ``full_dim`` features (two all-reduces of ``b x s``), ``y = x_hat w + b`` with
    ``x_hat = (x - mean) * rstd`` (``x_hat`` alone without ``w``, ``b``). Saves ``x_hat`` and ``rstd``, as ``F.layer_norm`` saves
    its input and statistics. Backward, with ``g = dy w`` and means over ``full_dim``
    (two all-reduces): ``dx = rstd (g - mean(g) - x_hat mean(g x_hat))``."""

    @staticmethod
    def forward(ctx, x, weight, bias, full_dim: int, eps: float, group):
        mean = sum_over_group(x.sum(-1, keepdim=True), group) / full_dim
        centered = x - mean
        var = sum_over_group(centered.pow(2).sum(-1, keepdim=True), group) / full_dim
        rstd = torch.rsqrt(var + eps)
        x_hat = centered.mul_(rstd)
        ctx.save_for_backward(x_hat, rstd, weight)
        ctx.full_dim, ctx.group, ctx.affine = full_dim, group, weight is not None
        return x_hat * weight + bias if ctx.affine else x_hat.clone()

    @staticmethod
    def backward(ctx, dy):
        x_hat, rstd, weight = ctx.saved_tensors
        g = dy * weight if ctx.affine else dy
        mean_g = sum_over_group(g.sum(-1, keepdim=True), ctx.group) / ctx.full_dim
        mean_gx = sum_over_group((g * x_hat).sum(-1, keepdim=True), ctx.group) / ctx.full_dim
        dx = (g - mean_g - x_hat * mean_gx) * rstd
        if not ctx.affine:
            return dx, None, None, None, None, None
        rows = tuple(range(dy.dim() - 1))
        return dx, (dy * x_hat).sum(rows), dy.sum(rows), None, None, None


class ParallelLayerNorm(nn.Module):
    """LayerNorm over a feature dimension that may be sharded across tensor-parallel ranks.

    Statistics cover the full hidden size (:class:`_ShardedLayerNorm`), so the result
    equals ``nn.LayerNorm(full_dim)`` on the unsharded tensor.
    """

    def __init__(self, full_dim: int, eps: float = 1e-5, tp_group: TensorParallelGroup = None) -> None:
        super().__init__()
        self.full_dim, self.eps = full_dim, eps
        self.tp_group = tp_group
        self.weight = _sharded_parameter(torch.ones(full_dim), 0, 1, tp_group)
        self.bias = _sharded_parameter(torch.zeros(full_dim), 0, 1, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.layer_norm(x, (self.full_dim,), self.weight, self.bias, self.eps)
        return _ShardedLayerNorm.apply(x, self.weight, self.bias, self.full_dim, self.eps, self.tp_group)


def sharded_normalize(x: torch.Tensor, full_dim: int, eps: float, tp_group: TensorParallelGroup) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over a last dimension of ``full_dim`` features split
    across ``tp_group`` (LayerNorm without its affine, :class:`_ShardedLayerNorm`)."""
    if group_size(tp_group) == 1:
        return F.layer_norm(x, (full_dim,), eps=eps)
    return _ShardedLayerNorm.apply(x, None, None, full_dim, eps, tp_group)
