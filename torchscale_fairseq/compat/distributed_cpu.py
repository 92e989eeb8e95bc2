"""Multi-process training on CPU with stock fairseq.

- ``torchrun`` sets ``MASTER_ADDR/PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``; fairseq
  then computes ``rank % torch.cuda.device_count()`` and divides by zero without GPUs.
  We take ``LOCAL_RANK`` as the device id (0 on CPU) instead.
- c10d ``DistributedDataParallel`` rejects ``device_ids`` for CPU modules; fairseq always
  passes them. Our subclass drops them when the module lives on the CPU.
"""

from __future__ import annotations

import os

import torch
from fairseq.distributed import utils as distributed_utils
from fairseq.models import distributed_fairseq_model
from torch.nn.parallel import DistributedDataParallel


def _infer_torchrun_init(cfg) -> None:
    cfg.distributed_init_method = "env://"
    cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
    cfg.distributed_rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", cfg.distributed_rank))
    gpus = torch.cuda.device_count()
    cfg.device_id = local_rank % gpus if gpus > 0 else 0
    cfg.distributed_no_spawn = True


class CpuAwareDistributedDataParallel(DistributedDataParallel):
    """``DistributedDataParallel`` that ignores ``device_ids``/``output_device`` on CPU."""

    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        on_cpu = all(p.device.type == "cpu" for p in module.parameters())
        if on_cpu:
            device_ids = output_device = None
        super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)


def patch_fairseq_distributed() -> None:
    distributed_utils._infer_torch_distributed_launch_init = _infer_torchrun_init
    distributed_fairseq_model.DistributedDataParallel = CpuAwareDistributedDataParallel
