"""Gradient reductions the tensor-parallel layout needs besides data parallelism."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from torchscale_fairseq.model_parallel.attributes import is_sequence_parallel
from torchscale_fairseq.model_parallel.process_groups import group_size


def sum_sequence_parallel_grads(model: torch.nn.Module, tp_group: dist.ProcessGroup | None) -> None:
    """Sequence parallelism: a replicated parameter used on each rank's slice of the
    sequence (LayerNorms, row-parallel biases) gets the gradient of those positions only;
    its full gradient is the sum over the tensor-parallel group (one coalesced all-reduce;
    Korthikanti et al. 2022, section 4.2.2). A gradient sharded over data parallelism (a
    DTensor, ``--zero-sharding full``) sums its local shard: the ranks of a tensor-parallel
    group hold the same rows."""
    if group_size(tp_group) == 1:
        return
    grads = [local_shard(p.grad)
             for p in model.parameters() if p.grad is not None and is_sequence_parallel(p)]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (``--zero-sharding full``). The class is looked up, not
    imported: a process that never imported ``torch.distributed.tensor`` holds none, and the
    import is most of the plugin's start-up."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_shard(grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a gradient sharded over data parallelism (a view: scaling it scales
    the DTensor); any other gradient as it is."""
    return grad.to_local() if is_dtensor(grad) else grad
