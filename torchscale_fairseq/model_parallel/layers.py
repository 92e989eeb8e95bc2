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

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import mark_sharded, mark_vocab_padded
from torchscale_fairseq.model_parallel.mappings import (
    all_reduce_sum,
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)
from torchscale_fairseq.model_parallel.partition import padded_vocab_size, shard_tensor
from torchscale_fairseq.model_parallel.process_groups import group_rank, group_size

TensorParallelGroup = dist.ProcessGroup | None

InitMethod = Callable[[torch.Tensor], None]


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
    n, rank = group_size(group), group_rank(group)
    return mark_sharded(nn.Parameter(shard_tensor(full, dim, stride, rank, n)), dim, stride)


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns (output features); output stays sharded
    unless ``gather_output``. ``stride`` > 1 keeps fused blocks (Q/K/V) whole per rank."""

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
    ) -> None:
        super().__init__()
        divide(out_features // stride, group_size(tp_group), what)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.stride = gather_output, stride
        self.tp_group = tp_group
        full = torch.empty(out_features, in_features)
        init_method(full)
        self.weight = _sharded_parameter(full, 0, stride, tp_group)
        self.bias = _sharded_parameter(torch.zeros(out_features), 0, stride, tp_group) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tensor_parallel_region(x, self.tp_group), self.weight, self.bias)
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
    all-reduced and the (replicated) bias is added once, after the all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method: InitMethod = xavier_normal_init,
        what: str = "input size",
        tp_group: TensorParallelGroup = None,
    ) -> None:
        super().__init__()
        divide(in_features, group_size(tp_group), what)
        self.in_features, self.out_features = in_features, out_features
        self.tp_group = tp_group
        full = torch.empty(out_features, in_features)
        init_method(full)
        self.weight = _sharded_parameter(full, 1, 1, tp_group)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.tp_group)
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
        full = torch.zeros(self.padded_num_embeddings, embedding_dim)
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


class ParallelLayerNorm(nn.Module):
    """LayerNorm over a feature dimension that may be sharded across tensor-parallel ranks.

    Statistics cover the full hidden size: per-token sums are all-reduced (two O(b x s)
    collectives), so the result equals ``nn.LayerNorm(full_dim)`` on the unsharded tensor.
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
        return sharded_normalize(x, self.full_dim, self.eps, self.tp_group) * self.weight + self.bias


def sharded_normalize(x: torch.Tensor, full_dim: int, eps: float, tp_group: TensorParallelGroup) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over a last dimension of ``full_dim`` features split
    across ``tp_group`` (LayerNorm without its affine): per-token sums all-reduced."""
    if group_size(tp_group) == 1:
        return F.layer_norm(x, (full_dim,), eps=eps)
    mean = all_reduce_sum(x.sum(-1, keepdim=True), tp_group) / full_dim
    centered = x - mean
    var = all_reduce_sum(centered.pow(2).sum(-1, keepdim=True), tp_group) / full_dim
    return centered * torch.rsqrt(var + eps)
