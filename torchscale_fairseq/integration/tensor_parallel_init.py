"""``--model-parallel-size N`` on stock fairseq, with our tensor parallelism; the edge where
the run's parallel context is built.

Stock ``distributed_utils.distributed_init`` imports the Megatron submodule when
``cfg.common.model_parallel_size > 1``. Ours runs it with the size hidden, then, at every
size, builds the run's groups once
(:func:`~torchscale_fairseq.model_parallel.parallel_context.build_parallel_context`: tensor,
data, pipeline (``--pipeline-model-parallel-size``), context (``--context-parallel-size``) and the expert groups of
``--moe-expert-parallel-size``, or of every divisor of the data-parallel size when it is 0, the
default, whose size follows from the expert count) and hands them to fairseq's factories
(:func:`~torchscale_fairseq.model_parallel.parallel_context.set_parallel_context`); under tensor
parallelism it also seeds the per-rank RNG stream and sets the checkpoint suffix
``-model_part-{tp_rank}`` (one checkpoint part per tensor-parallel rank). Without a GPU it uses
gloo instead of the default NCCL, and ``--bf16`` without ``torch_xla`` is not a TPU run
(:mod:`.bf16_device`).
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import torch
import torch.distributed as dist
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from omegaconf import open_dict

from torchscale_fairseq.checkpoints.layout import checkpoint_suffix
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.bf16_device import bf16_without_tpu
from torchscale_fairseq.model_parallel.parallel_context import build_parallel_context, set_parallel_context
from torchscale_fairseq.model_parallel.random import model_parallel_seed

STOCK_DISTRIBUTED_INIT = distributed_utils.distributed_init


def expert_parallel_sizes(model_cfg: Any, data_size: int) -> list[int] | None:
    """The expert-parallel sizes the model may ask its context for: ``--moe-expert-parallel-size``
    where it is given (and divides ``data_size``, the data-parallel x context-parallel size; otherwise
    the model's build names the mismatch), else ``None``: every divisor (the default size follows from the expert count, which
    the evaluation tools learn only from the checkpoint)."""
    size = (getattr(model_cfg, "moe_expert_parallel_size", 0) or 0) if model_cfg is not None else 0
    if size <= 0:
        return None
    return [size] if data_size % size == 0 else []


def distributed_init(cfg) -> int:
    """fairseq's ``distributed_init`` plus the run's parallel context (module docstring)."""
    if isinstance(cfg, Namespace):
        cfg = convert_namespace_to_omegaconf(cfg)
    bf16_without_tpu(cfg)
    dt = cfg.distributed_training
    if dt.distributed_backend == "nccl" and not torch.cuda.is_available():
        with open_dict(cfg):
            dt.distributed_backend = "gloo"
    tp_size = cfg.common.model_parallel_size
    with open_dict(cfg):
        cfg.common.model_parallel_size = 1
        try:
            rank = STOCK_DISTRIBUTED_INIT(cfg)
        finally:
            cfg.common.model_parallel_size = tp_size
    if not dist.is_initialized():  # a TPU run: torch_xla's own groups
        return rank
    model_cfg = getattr(cfg, "model", None)
    pipeline_size = (getattr(model_cfg, "pipeline_model_parallel_size", 1) or 1) if model_cfg is not None else 1
    context_size = (getattr(model_cfg, "context_parallel_size", 1) or 1) if model_cfg is not None else 1
    data_context_size = dist.get_world_size() // (max(tp_size, 1) * pipeline_size)
    context = build_parallel_context(max(tp_size, 1), pipeline_size, expert_parallel_sizes(model_cfg, data_context_size),
                                     context_size)
    set_parallel_context(context)
    if tp_size > 1:
        model_parallel_seed(cfg.common.seed, context.tensor_rank, tp_size)
        with open_dict(cfg):  # named by the one checkpoint layout (generate / eval-lm read this suffix)
            cfg.checkpoint.checkpoint_suffix = checkpoint_suffix(
                context.tensor_rank, tp_size, 0, 1, cfg.checkpoint.checkpoint_suffix or "")
    return rank


def multi_process_error(size: int) -> TsConfigError:
    """The one-line error for ``--model-parallel-size N`` in a single process."""
    return TsConfigError(
        f"--model-parallel-size {size} needs a multi-process run: launch {size} (or a multiple) processes "
        "with torchrun, or pass --distributed-world-size/--distributed-rank/--distributed-init-method "
        "(--distributed-no-spawn on CPU)"
    )
