"""``--model-parallel-size N`` on stock fairseq, with our tensor parallelism.

Stock ``distributed_utils.distributed_init`` imports the Megatron submodule when
``cfg.common.model_parallel_size > 1``. We run it with the size hidden, then create our
groups (:func:`~torchscale_fairseq.model_parallel.process_groups.initialize_model_parallel`),
seed the per-rank RNG stream and set the checkpoint suffix ``-model_part-{tp_rank}``
(one checkpoint part per tensor-parallel rank, saved by the ranks with data-parallel
rank 0). fairseq's ``get_data_parallel_*`` / ``get_model_parallel_*`` then return our
groups, so the trainer reduces gradients and shards batches over data-parallel groups
only (the ranks of one tensor-parallel group see identical batches), and its
``broadcast`` takes the source as a rank *within* the group, as all its callers assume.

:func:`patch_fairseq_model_parallel` also installs the grad-norm, trainer, checkpoint,
CLI and criterion patches of the sibling modules.
"""

from __future__ import annotations

from argparse import Namespace

import torch
import torch.distributed as dist
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from omegaconf import open_dict

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel import process_groups as groups
from torchscale_fairseq.model_parallel.random import model_parallel_seed

_STOCK = {
    name: getattr(distributed_utils, name)
    for name in ("distributed_init", "get_data_parallel_group", "broadcast")
}


def distributed_init(cfg) -> int:
    """fairseq's ``distributed_init`` plus our tensor-parallel groups for ``N > 1``
    (and gloo instead of the default NCCL when there is no GPU)."""
    if isinstance(cfg, Namespace):
        cfg = convert_namespace_to_omegaconf(cfg)
    dt = cfg.distributed_training
    if dt.distributed_backend == "nccl" and not torch.cuda.is_available():
        with open_dict(cfg):
            dt.distributed_backend = "gloo"
    tp_size = cfg.common.model_parallel_size
    if tp_size <= 1:
        return _STOCK["distributed_init"](cfg)
    with open_dict(cfg):
        cfg.common.model_parallel_size = 1
        try:
            rank = _STOCK["distributed_init"](cfg)
        finally:
            cfg.common.model_parallel_size = tp_size
    groups.initialize_model_parallel(tp_size)
    model_parallel_seed(cfg.common.seed)
    with open_dict(cfg):
        cfg.checkpoint.checkpoint_suffix += f"-model_part-{groups.get_tensor_parallel_rank()}"
    return rank


def multi_process_error(size: int) -> TsConfigError:
    """The one-line error for ``--model-parallel-size N`` in a single process."""
    return TsConfigError(
        f"--model-parallel-size {size} needs a multi-process run: launch {size} (or a multiple) processes "
        "with torchrun, or pass --distributed-world-size/--distributed-rank/--distributed-init-method "
        "(--distributed-no-spawn on CPU)"
    )


def get_data_parallel_group():
    """Our data-parallel group under tensor parallelism, else fairseq's global group."""
    if groups.model_parallel_is_initialized():
        return groups.get_data_parallel_group()
    return _STOCK["get_data_parallel_group"]()


def get_model_parallel_group():
    return groups.get_tensor_parallel_group()


def get_model_parallel_rank() -> int:
    return groups.get_tensor_parallel_rank()


def get_model_parallel_world_size() -> int:
    return groups.get_tensor_parallel_world_size()


def broadcast(tensor, src: int, group) -> None:
    """Broadcast from the rank ``src`` *of* ``group`` (stock fairseq passes it to
    ``dist.broadcast`` as a global rank, wrong for data-parallel groups like ``[1, 3]``)."""
    if distributed_utils.use_xla() or group is None:
        return _STOCK["broadcast"](tensor, src, group)
    dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)


def patch_fairseq_model_parallel() -> None:
    """Install every tensor-parallel patch of the plugin (idempotent)."""
    from torchscale_fairseq.compat import (
        grad_norm_clip,
        model_parallel_checkpoints,
        model_parallel_cli,
        model_parallel_trainer,
    )
    from torchscale_fairseq.criterions import vocab_parallel

    distributed_utils.distributed_init = distributed_init
    distributed_utils.get_data_parallel_group = get_data_parallel_group
    distributed_utils.get_model_parallel_group = get_model_parallel_group
    distributed_utils.get_model_parallel_rank = get_model_parallel_rank
    distributed_utils.get_model_parallel_world_size = get_model_parallel_world_size
    distributed_utils.broadcast = broadcast
    grad_norm_clip.patch_clip_grad_norm()
    model_parallel_trainer.patch_trainer()
    model_parallel_checkpoints.patch_checkpoint_loading()
    model_parallel_cli.patch_generate_and_eval_lm()
    vocab_parallel.install()
