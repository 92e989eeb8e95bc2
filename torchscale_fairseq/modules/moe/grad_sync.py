"""Expert gradients under data parallelism.

Ranks hold different experts under the same parameter names, so data parallelism must
neither broadcast nor average expert parameters. Their gradients already contain every
rank's tokens (the all-to-all backward brings them home), so an expert's gradient is
summed over its replica group (the run's context's expert groups of the size the parameter is
tagged with) and divided by the data-context size ``W`` (data-parallel x context-parallel ranks,
over which DDP averages), matching DDP's mean for the dense parameters (fairseq then multiplies
all gradients by ``W / sample_size``): DDP is told to leave the experts out
(:func:`keep_experts_out_of_ddp`) and the wrapper's gradient all-reduce is followed by
:func:`sync_expert_grads` (:func:`sync_experts_after`); the trainer calls both when it wraps the model.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import expert_parallel_size, is_expert
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext

EXPERT_DDP_BACKENDS = ("c10d", "pytorch_ddp", "legacy_ddp", "no_c10d")  # fairseq's wrappers that can ignore parameters


def expert_parameter_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if is_expert(p)]


def keep_experts_out_of_ddp(model: nn.Module, ddp_backend: str) -> bool:
    """Tell the data-parallel wrapper (``--ddp-backend``) to neither broadcast nor average the expert
    parameters of ``model``; whether it has any. A backend that cannot is refused in one line."""
    experts = expert_parameter_names(model)
    if not experts:
        return False
    if ddp_backend not in EXPERT_DDP_BACKENDS:
        raise TsConfigError(f"--ddp-backend {ddp_backend} cannot keep experts apart: use --ddp-backend c10d or legacy_ddp")
    model._ddp_params_and_buffers_to_ignore = experts
    return True


def sync_experts_after(wrapped: nn.Module, model: nn.Module, parallel: ParallelContext) -> None:
    """The wrapper's ``all_reduce_grads`` (called by every fairseq optimizer before clipping) also
    averages the expert gradients of ``model`` (:func:`sync_expert_grads`)."""
    previous = getattr(wrapped, "all_reduce_grads", None)

    def all_reduce_grads() -> None:
        if previous is not None:
            previous()
        sync_expert_grads(model, parallel)

    object.__setattr__(wrapped, "all_reduce_grads", all_reduce_grads)


def sync_expert_grads(model: nn.Module, parallel: ParallelContext) -> None:
    """``g <- (sum over the replica group of g) / W`` for every expert parameter."""
    for p in model.parameters():
        if not is_expert(p) or p.grad is None:
            continue
        group = parallel.expert_groups_of(expert_parallel_size(p)).replica_group
        if group is not None:
            dist.all_reduce(p.grad, group=group)
        if parallel.data_context_size > 1:
            p.grad.div_(parallel.data_context_size)
