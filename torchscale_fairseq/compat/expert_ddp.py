"""Upstream: fairseq's ``DistributedFairseqModel`` averages every gradient over the
data-parallel group, which is wrong for expert parameters (ranks hold different experts
under the same names; see :mod:`torchscale_fairseq.modules.moe.grad_sync`).

:func:`patch_distributed_wrapper` wraps it so that (1) ``torch`` DDP ignores expert
parameters and (2) the wrapper's ``all_reduce_grads`` (called by every fairseq optimizer
before clipping) also runs :func:`sync_expert_grads`. ``legacy_ddp`` already skips
parameters with ``expert``. Models without experts get fairseq's wrapper unchanged.
"""

from __future__ import annotations

import torch.distributed as dist

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.moe.grad_sync import expert_parameter_names, sync_expert_grads

SUPPORTED_BACKENDS = ("c10d", "pytorch_ddp", "legacy_ddp", "no_c10d")


def _data_parallel_size(process_group) -> int:
    if process_group is not None:
        return dist.get_world_size(process_group)
    return dist.get_world_size() if dist.is_initialized() else 1


def patch_distributed_wrapper() -> None:
    """Install the wrapper described in the module docstring (idempotent)."""
    import fairseq.models as fairseq_models

    original = fairseq_models.DistributedFairseqModel
    if getattr(original, "_ts_expert_aware", False):
        return

    def wrap(args, model, process_group, device):
        names = expert_parameter_names(model)
        if not names:
            return original(args, model, process_group, device)
        if args.ddp_backend not in SUPPORTED_BACKENDS:
            raise TsConfigError(
                f"--ddp-backend {args.ddp_backend} cannot keep experts apart: use --ddp-backend c10d or legacy_ddp"
            )
        model._ddp_params_and_buffers_to_ignore = names
        wrapped = original(args, model, process_group, device)
        size = _data_parallel_size(process_group)
        previous = getattr(wrapped, "all_reduce_grads", None)

        def all_reduce_grads() -> None:
            if previous is not None:
                previous()
            sync_expert_grads(model, size)

        object.__setattr__(wrapped, "all_reduce_grads", all_reduce_grads)
        return wrapped

    wrap._ts_expert_aware = True
    fairseq_models.DistributedFairseqModel = wrap
