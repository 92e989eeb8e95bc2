"""The trainer ``fairseq-train`` uses at ``--model-parallel-size N > 1``.

Stock ``train.py`` builds a ``MegatronTrainer`` (which needs the Megatron submodule and
adds replicated parameters once per rank to the grad norm). Ours is fairseq's
``Trainer``: gradients are reduced over the data-parallel group (see
:mod:`~torchscale_fairseq.compat.model_parallel_init`), the grad norm counts every
gradient once (:mod:`~torchscale_fairseq.compat.grad_norm_clip`), each rank with
data-parallel rank 0 saves its own part, and the RNG tracker's per-rank stream is
restored from the checkpoint.

Every checkpoint (any N, through a wrapper of ``Trainer.state_dict``) records in
``extra_state["ts_tensor_parallel"]`` the size N, the layout of the sharded parameters
(:func:`~torchscale_fairseq.model_parallel.partition.layout`), the names of the trainable
parameters in optimizer order (both used by ``ts-reshard``) and the RNG tracker's state.
"""

from __future__ import annotations

import sys

from fairseq.model_parallel import megatron_trainer
from fairseq.trainer import Trainer

from torchscale_fairseq.compat.model_parallel_init import multi_process_error
from torchscale_fairseq.model_parallel.partition import layout
from torchscale_fairseq.model_parallel.process_groups import (
    get_tensor_parallel_world_size,
    model_parallel_is_initialized,
)
from torchscale_fairseq.model_parallel.random import get_rng_tracker

TP_STATE_KEY = "ts_tensor_parallel"


class ModelParallelTrainer(Trainer):
    """fairseq's ``Trainer`` under tensor parallelism."""

    def __init__(self, cfg, task, model, criterion, quantizer=None, **kwargs) -> None:
        if not model_parallel_is_initialized():
            raise multi_process_error(cfg.common.model_parallel_size)
        super().__init__(cfg, task, model, criterion, quantizer, **kwargs)

    def load_checkpoint(self, filename, *args, **kwargs):
        extra_state = super().load_checkpoint(filename, *args, **kwargs)
        saved = (extra_state or {}).get(TP_STATE_KEY) or {}
        if saved.get("size") == get_tensor_parallel_world_size() and saved.get("rng"):
            get_rng_tracker().load_state_dict(saved["rng"])
        return extra_state


def tensor_parallel_state(model) -> dict:
    """What a checkpoint records about tensor parallelism."""
    return {
        "size": get_tensor_parallel_world_size(),
        "layout": layout(model),
        "params": [name for name, p in model.named_parameters() if p.requires_grad],
        "rng": get_rng_tracker().state_dict(),
    }


def patch_trainer() -> None:
    """Make ``fairseq_cli.train`` (also when run as ``python -m``) use our trainer and
    record the tensor-parallel state in every checkpoint (idempotent)."""
    if not getattr(Trainer.state_dict, "_ts_tensor_parallel", False):
        stock_state_dict = Trainer.state_dict

        def state_dict(self):
            state = stock_state_dict(self)
            state["extra_state"][TP_STATE_KEY] = tensor_parallel_state(self.get_model())
            return state

        state_dict._ts_tensor_parallel = True
        Trainer.state_dict = state_dict
    megatron_trainer.MegatronTrainer = ModelParallelTrainer
    for name in ("fairseq_cli.train", "__main__"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "MegatronTrainer"):
            module.MegatronTrainer = ModelParallelTrainer
