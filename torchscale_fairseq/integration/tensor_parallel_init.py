"""``--model-parallel-size N`` on stock fairseq, with our tensor parallelism.

Stock ``distributed_utils.distributed_init`` imports the Megatron submodule when
``cfg.common.model_parallel_size > 1``. Ours runs it with the size hidden, then creates
our groups (:func:`~torchscale_fairseq.model_parallel.process_groups.initialize_model_parallel`),
seeds the per-rank RNG stream and sets the checkpoint suffix ``-model_part-{tp_rank}``
(one checkpoint part per tensor-parallel rank). Without a GPU it uses gloo instead of
the default NCCL, and ``--bf16`` without ``torch_xla`` is not a TPU run (:mod:`.bf16_device`).
"""

from __future__ import annotations

from argparse import Namespace

import torch
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from omegaconf import open_dict

from torchscale_fairseq.checkpoints.layout import checkpoint_suffix
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.bf16_device import bf16_without_tpu
from torchscale_fairseq.model_parallel import process_groups as groups
from torchscale_fairseq.model_parallel.random import model_parallel_seed

STOCK_DISTRIBUTED_INIT = distributed_utils.distributed_init


def distributed_init(cfg) -> int:
    """fairseq's ``distributed_init`` plus our tensor-parallel groups for ``N > 1``."""
    if isinstance(cfg, Namespace):
        cfg = convert_namespace_to_omegaconf(cfg)
    bf16_without_tpu(cfg)
    dt = cfg.distributed_training
    if dt.distributed_backend == "nccl" and not torch.cuda.is_available():
        with open_dict(cfg):
            dt.distributed_backend = "gloo"
    tp_size = cfg.common.model_parallel_size
    if tp_size <= 1:
        return STOCK_DISTRIBUTED_INIT(cfg)
    with open_dict(cfg):
        cfg.common.model_parallel_size = 1
        try:
            rank = STOCK_DISTRIBUTED_INIT(cfg)
        finally:
            cfg.common.model_parallel_size = tp_size
    groups.initialize_model_parallel(tp_size)
    model_parallel_seed(cfg.common.seed, groups.get_tensor_parallel_rank(), tp_size)
    with open_dict(cfg):  # named by the one checkpoint layout (generate / eval-lm read this suffix)
        cfg.checkpoint.checkpoint_suffix = checkpoint_suffix(
            groups.get_tensor_parallel_rank(), tp_size, 0, 1, cfg.checkpoint.checkpoint_suffix or "")
    return rank


def multi_process_error(size: int) -> TsConfigError:
    """The one-line error for ``--model-parallel-size N`` in a single process."""
    return TsConfigError(
        f"--model-parallel-size {size} needs a multi-process run: launch {size} (or a multiple) processes "
        "with torchrun, or pass --distributed-world-size/--distributed-rank/--distributed-init-method "
        "(--distributed-no-spawn on CPU)"
    )
