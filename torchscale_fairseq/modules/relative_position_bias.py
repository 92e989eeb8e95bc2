"""T5 relative position bias (Raffel et al. 2020, section 2.1): a learned scalar per head
and log-spaced distance bucket, added to the attention logits and shared by all layers."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from torchscale_fairseq.device_init import on_default_device
from torchscale_fairseq.model_parallel.attributes import mark_sharded
from torchscale_fairseq.model_parallel.layers import TensorParallelGroup, divide
from torchscale_fairseq.model_parallel.partition import shard_tensor
from torchscale_fairseq.model_parallel.process_groups import (
    group_rank,
    group_size,
)


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Bucket of ``key_pos - query_pos``: exact for small distances, log-spaced up to ``max_distance``."""
    bucket = torch.zeros_like(relative)
    n = -relative
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, n, large)


class RelativePositionBias(nn.Module):
    """Returns the ``(1, local_heads, q_len, k_len)`` additive bias; heads are sharded
    across tensor-parallel ranks like the attention heads they feed."""

    def __init__(self, num_heads: int, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128,
                 tp_group: TensorParallelGroup = None) -> None:
        super().__init__()
        self.bidirectional, self.num_buckets, self.max_distance = bidirectional, num_buckets, max_distance
        n = group_size(tp_group)
        divide(num_heads, n, "number of attention heads")
        full = torch.empty(num_buckets, num_heads, device="cpu")  # drawn on the CPU: device_init.py
        nn.init.normal_(full)
        self.weight = mark_sharded(nn.Parameter(on_default_device(shard_tensor(full, 1, 1, group_rank(tp_group), n))), 1)

    def forward(self, q_len: int, k_len: int, offset: int = 0) -> torch.Tensor:
        """Bias for queries at positions ``offset .. offset + q_len - 1`` and keys ``0 .. k_len - 1``."""
        q_pos = torch.arange(offset, offset + q_len, device=self.weight.device)[:, None]
        k_pos = torch.arange(k_len, device=self.weight.device)[None, :]
        buckets = relative_position_bucket(k_pos - q_pos, self.bidirectional, self.num_buckets, self.max_distance)
        return self.weight[buckets].permute(2, 0, 1).unsqueeze(0)
