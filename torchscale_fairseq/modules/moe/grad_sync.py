"""Expert gradients under data parallelism.

Ranks hold different experts under the same parameter names, so data parallelism must
neither broadcast nor average expert parameters. Their gradients already contain every
rank's tokens (the all-to-all backward brings them home), so an expert's gradient is
summed over its replica group (the run's context's expert groups of the size the parameter is
tagged with) and divided by the data-parallel size ``W``, matching DDP's mean for the dense
parameters (fairseq then multiplies all gradients by ``W / sample_size``). The fairseq wiring is
in :mod:`torchscale_fairseq.integration.trainer`.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from torchscale_fairseq.model_parallel.attributes import expert_parallel_size, is_expert
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext


def expert_parameter_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if is_expert(p)]


def sync_expert_grads(model: nn.Module, parallel: ParallelContext) -> None:
    """``g <- (sum over the replica group of g) / W`` for every expert parameter."""
    for p in model.parameters():
        if not is_expert(p) or p.grad is None:
            continue
        group = parallel.expert_groups_of(expert_parallel_size(p)).replica_group
        if group is not None:
            dist.all_reduce(p.grad, group=group)
        if parallel.data_size > 1:
            p.grad.div_(parallel.data_size)
