"""Upstream bugs (fairseq 0.12.2, fairseq-fixed 0.12.3.1): multi-process training on CPU.

- ``torchrun`` sets ``MASTER_ADDR/PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``. Stock
  fairseq ignores them when ``--distributed-world-size`` is left at its default (the
  number of GPUs, 1 on CPU: every process trains alone) and otherwise computes
  ``rank % torch.cuda.device_count()``, dividing by zero without GPUs. We take the world
  size and rank from torchrun and ``LOCAL_RANK`` as the device id (0 on CPU).
- c10d ``DistributedDataParallel`` rejects ``device_ids`` for CPU modules; fairseq always
  passes them. Our subclass drops them when the module lives on the CPU.
"""

from __future__ import annotations

import os

import torch
from fairseq.distributed import utils as distributed_utils
from fairseq.models import distributed_fairseq_model
from torch.nn.parallel import DistributedDataParallel

_TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
_stock_infer_init_method = distributed_utils.infer_init_method


def launched_by_torchrun() -> bool:
    return all(key in os.environ for key in _TORCHRUN_ENV) and int(os.environ["WORLD_SIZE"]) > 1


def infer_init_method(cfg, force_distributed: bool = False) -> None:
    """fairseq's ``infer_init_method``, taking torchrun's environment when present."""
    if cfg.distributed_init_method is not None or not launched_by_torchrun():
        return _stock_infer_init_method(cfg, force_distributed)
    cfg.distributed_init_method = "env://"
    cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
    cfg.distributed_rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", cfg.distributed_rank))
    gpus = torch.cuda.device_count()
    cfg.device_id = local_rank % gpus if gpus > 0 else 0
    cfg.distributed_no_spawn = True
    if gpus > 0:
        torch.cuda.set_device(cfg.device_id)


class CpuAwareDistributedDataParallel(DistributedDataParallel):
    """``DistributedDataParallel`` that ignores ``device_ids``/``output_device`` on CPU."""

    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)


def patch_fairseq_distributed() -> None:
    distributed_utils.infer_init_method = infer_init_method
    distributed_fairseq_model.DistributedDataParallel = CpuAwareDistributedDataParallel
