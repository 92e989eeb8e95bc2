"""Where a stack enters and leaves the sequence-parallel region (Korthikanti et al. 2022,
section 4.2.2), in training with ``--sequence-parallel``: the token ids are padded to a
multiple of the tensor-parallel size ``t`` (padding tokens, so every attention and loss
mask already ignores them; document ids likewise), the embedding output is split along the sequence, each rank
runs LayerNorms, dropout and residuals on its ``T / t`` positions, and the final
features are gathered and cut back to ``T`` before the output layer or the cross-attention
that reads them. An MoE layer gathers the whole sequence at its entry and keeps its
slice at its exit (:class:`~torchscale_fairseq.modules.moe.layer.MoELayer`): it routes
the tokens of every rank, with the stack's full-length padding mask (the padding added
here included), as without the split. Evaluation and decoding run the same weights
without the split."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.model_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from torchscale_fairseq.model_parallel.process_groups import group_rank, group_size


def is_split(cfg: StackConfig, training: bool) -> bool:
    """Whether activations between the tensor-parallel blocks are split along the sequence."""
    return cfg.sequence_parallel and training


def pad_tokens(tokens: torch.Tensor, cfg: StackConfig, pad: int) -> torch.Tensor:
    """``tokens`` (B, T) right-padded with ``pad`` to a multiple of the tensor-parallel size."""
    extra = -tokens.size(1) % group_size(cfg.tp_group)
    return F.pad(tokens, (0, extra), value=pad) if extra else tokens


def pad_document_ids(document_ids: torch.Tensor, cfg: StackConfig) -> torch.Tensor:
    """``document_ids`` (B, T) padded as :func:`pad_tokens` pads the tokens: the padding joins each row's
    last document (under causal attention no real token sees it; bidirectional, the padding mask hides it)."""
    extra = -document_ids.size(1) % group_size(cfg.tp_group)
    return torch.cat([document_ids, document_ids[:, -1:].expand(-1, extra)], 1) if extra else document_ids


def split_sequence(x: torch.Tensor, cfg: StackConfig) -> torch.Tensor:
    """This rank's ``(B, T / t, C)`` slice of the stack's input."""
    return scatter_to_sequence_parallel_region(x, cfg.tp_group)


def sequence_slice(mask: torch.Tensor, cfg: StackConfig) -> torch.Tensor:
    """This rank's positions of a ``(B, T, ...)`` tensor outside autograd (e.g. a padding mask)."""
    return mask.chunk(group_size(cfg.tp_group), dim=1)[group_rank(cfg.tp_group)]


def gather_sequence(x: torch.Tensor, cfg: StackConfig, length: int) -> torch.Tensor:
    """The full ``(B, length, C)`` features from every rank's slice (padding cut off). Each
    rank's consumer (the vocabulary-parallel output, a column-parallel K/V projection)
    sums its gradient over the group itself, so the backward keeps this rank's slice."""
    return gather_from_sequence_parallel_region(x, cfg.tp_group)[:, :length]
