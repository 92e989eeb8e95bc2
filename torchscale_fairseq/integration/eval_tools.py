"""``fairseq-generate`` and ``fairseq-eval-lm`` with ``--model-parallel-size N``.

Stock ``generate`` never initialises torch.distributed and both tools shard the data
by *global* rank. Our ``main`` wrapper initialises it (same flags as training: one
process per rank with ``--distributed-world-size/--distributed-rank/
--distributed-init-method --distributed-no-spawn``, or torchrun), shards the data by
*data-parallel* rank so the ranks of a tensor-parallel group decode the same batches in
lockstep, and lets only tensor-parallel rank 0 write hypotheses (stdout or
``--results-path``). Logits are gathered over the vocabulary only where search needs
them (``get_normalized_probs`` of the last position).
"""

from __future__ import annotations

import contextlib
import functools
import os
from argparse import Namespace

import torch.distributed as dist
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from omegaconf import open_dict

from torchscale_fairseq.integration.tensor_parallel_init import multi_process_error
from torchscale_fairseq.model_parallel.parallel_context import current_parallel_context


def _run_on_tensor_parallel_rank(stock_main, cfg, **kwargs):
    dt = cfg.distributed_training
    saved = (dt.distributed_world_size, dt.distributed_rank, cfg.common_eval.results_path)
    parallel = current_parallel_context()  # read once, at the tool's start (the edge just built it)
    quiet = parallel.tensor_rank > 0
    with open_dict(cfg):
        dt.distributed_world_size = parallel.data_size
        dt.distributed_rank = parallel.data_rank
        if quiet:
            cfg.common_eval.results_path = None
    try:
        with contextlib.ExitStack() as stack:
            if quiet:
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
            return stock_main(cfg, **kwargs)
    finally:
        with open_dict(cfg):
            dt.distributed_world_size, dt.distributed_rank, cfg.common_eval.results_path = saved


def wrap_main(stock_main):
    """``main`` of ``fairseq_cli.generate`` / ``fairseq_cli.eval_lm``, also under tensor parallelism."""

    @functools.wraps(stock_main)
    def main(cfg, **kwargs):
        if isinstance(cfg, Namespace):
            cfg = convert_namespace_to_omegaconf(cfg)
        if cfg.common.model_parallel_size <= 1:
            return stock_main(cfg, **kwargs)
        if not dist.is_initialized():
            if cfg.distributed_training.distributed_init_method is None:
                distributed_utils.infer_init_method(cfg.distributed_training)
            if cfg.distributed_training.distributed_init_method is None:
                raise multi_process_error(cfg.common.model_parallel_size)
            return distributed_utils.call_main(cfg, main, **kwargs)
        return _run_on_tensor_parallel_rank(stock_main, cfg, **kwargs)

    return main


