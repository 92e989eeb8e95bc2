"""Every attribute a parameter carries about how it is distributed, in one registry
(Megatron-LM's ``_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS``), with the helpers that set, read
and copy them. Tags only: no process group (those are in the run's parallel context).

- tensor parallelism: ``tensor_parallel_dim`` (split dimension, ``None`` = replicated),
  ``tensor_parallel_stride`` (independent blocks along it, e.g. 3 for fused Q/K/V),
  ``tensor_parallel_vocab`` (real vocabulary size of a padded vocabulary dimension);
- sequence parallelism: ``sequence_parallel`` (a replicated parameter used on this rank's
  slice of the sequence only, whose gradient is summed over the tensor-parallel group);
- expert parallelism: ``expert`` (ranks hold different experts under the same name) and
  ``expert_parallel_size`` (``A``, the all-to-all size its experts are spread over: the key of its
  groups in the run's
  :class:`~torchscale_fairseq.model_parallel.parallel_context.ParallelContext`, whose
  ``expert_groups_of(A)`` gives the ranks holding the *other* experts, for the gradient norm, and
  those holding a copy of the *same* experts, for gradient averaging);
- pipeline parallelism: ``pipeline_tied`` (``"original"``: the first stage's input embedding,
  ``"copy"``: the last stage's copy of it, the tied output layer; their gradients are summed
  over the embedding group, and the gradient norm counts the original only).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

TP_DIM = "tensor_parallel_dim"
TP_STRIDE = "tensor_parallel_stride"
TP_VOCAB = "tensor_parallel_vocab"
SEQUENCE_PARALLEL = "sequence_parallel"
EXPERT = "expert"
EXPERT_PARALLEL_SIZE = "expert_parallel_size"
PIPELINE_TIED = "pipeline_tied"

PARALLEL_ATTRIBUTE_DEFAULTS: dict[str, Any] = {
    TP_DIM: None,
    TP_STRIDE: 1,
    TP_VOCAB: None,
    SEQUENCE_PARALLEL: False,
    EXPERT: False,
    EXPERT_PARALLEL_SIZE: 1,
    PIPELINE_TIED: None,
}


def copy_parallel_attributes(destination: Any, source: torch.Tensor) -> None:
    """Give ``destination`` (e.g. an fp32 master copy) every attribute ``source`` carries."""
    for name in PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def mark_sharded(param: torch.Tensor, dim: int, stride: int = 1) -> torch.Tensor:
    setattr(param, TP_DIM, dim)
    setattr(param, TP_STRIDE, stride)
    return param


def mark_vocab_padded(param: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mark a parameter whose split dimension is the padded vocabulary of ``vocab_size``."""
    setattr(param, TP_VOCAB, vocab_size)
    return param


def sharded_dim(param: Any) -> int | None:
    """The split dimension of a sharded parameter, ``None`` for a replicated one."""
    return getattr(param, TP_DIM, None)


def mark_sequence_parallel(params: Iterable[torch.Tensor]) -> None:
    """Mark replicated parameters used on this rank's slice of the sequence only."""
    for param in params:
        setattr(param, SEQUENCE_PARALLEL, True)


def is_sequence_parallel(param: Any) -> bool:
    return bool(getattr(param, SEQUENCE_PARALLEL, False))


def mark_expert(param: torch.Tensor, expert_parallel_size: int) -> None:
    """Mark the experts of a rank, spread over all-to-all groups of ``expert_parallel_size`` ranks."""
    setattr(param, EXPERT, True)
    setattr(param, EXPERT_PARALLEL_SIZE, expert_parallel_size)


def is_expert(param: Any) -> bool:
    return bool(getattr(param, EXPERT, False))


def expert_parallel_size(param: Any) -> int:
    """The all-to-all size an expert parameter's experts are spread over (1: all local)."""
    return int(getattr(param, EXPERT_PARALLEL_SIZE, 1))


def mark_pipeline_tied(param: torch.Tensor, role: str) -> None:
    """``role``: ``"original"`` (first stage) or ``"copy"`` (last stage)."""
    setattr(param, PIPELINE_TIED, role)


def pipeline_tied_role(param: Any) -> str | None:
    return getattr(param, PIPELINE_TIED, None)
