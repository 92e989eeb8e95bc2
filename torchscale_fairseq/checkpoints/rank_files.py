"""Each rank's checkpoint file as the trainer writes and reads it: the record written beside the
model (:func:`rank_record`, the format in :mod:`.layout`) and the checks that refuse, in one line,
a load that would resume wrongly (:func:`check_saved_layout`, :func:`check_ranks_resume_together`,
:func:`restore_from_record`)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from torchscale_fairseq.checkpoints.layout import (
    RECORD_KEY,
    PipelineRecord,
    check_optimizer_order,
    checkpoint_name,
    describe,
    find_checkpoint_files,
    has_saved_files,
    newest_complete_checkpoint,
)
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.model_parallel.random import get_rng_tracker


def rank_record(model: torch.nn.Module, parallel: ParallelContext, ep_size: int, ep_rank: int,
                stack_names: tuple[str, tuple[str, str] | None] | None = None) -> dict:
    """This rank's record (:func:`~.layout.describe`): tensor-parallel layout, expert shard, RNG
    tracker and, for a model with a layer stack a pipeline splits (``model.pipeline_stack``), its
    stage; ``stack_names``: the stack's prefix and tied pair (a stage's modules are named as one
    process's: no renaming)."""
    pipeline = PipelineRecord()
    stack = getattr(model, "pipeline_stack", None)
    if stack is not None and stack_names is not None:
        split = stack.split
        pipeline = PipelineRecord(parallel.pipeline_size, parallel.pipeline_rank, split.chunks,
                                  split.counts if parallel.pipeline_size > 1 else None, *stack_names)
    return describe(model, parallel.tensor_size, parallel.tensor_rank, ep_size, ep_rank,
                    get_rng_tracker().state_dict(), pipeline)


def check_saved_layout(filename: str) -> None:
    """This rank's file is missing but the checkpoint was saved with another layout (another
    tensor-parallel or pipeline size, or data-parallel size of an expert-sharded run): one line
    instead of a silent fresh start."""
    name = checkpoint_name(filename)
    if "://" in filename or os.path.exists(filename) or not has_saved_files(name):
        return
    files = find_checkpoint_files(name)
    raise TsConfigError(
        f"{filename} does not exist but {name} was saved as {files.tp_size} tensor-parallel part(s) x "
        f"{files.pp_size} pipeline stage(s) x {files.ep_size} expert shard(s): resume with that layout, or "
        "convert it (ts-reshard, ts-consolidate-experts) and start from the result with --restore-file"
    )


def check_ranks_resume_together(filename: str, num_updates: int, base_suffix: str) -> None:
    """Ranks that each read their own file must go on from one update. A run killed between two
    ranks' writes of ``checkpoint_last`` leaves parts of different updates, and ranks that resume
    from different updates wait on each other forever: one line naming the newest checkpoint every
    file holds instead. Collective over the world."""
    loaded: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(loaded, (num_updates if os.path.exists(filename) else None, filename))
    if len({updates for updates, _ in loaded}) == 1:
        return
    known = [updates for updates, _ in loaded if updates is not None]
    shown = ", ".join(f"{os.path.basename(path)} @ {'missing' if updates is None else updates}"
                      for updates, path in sorted(set(loaded), key=lambda item: item[1])[:4])
    save_dir = os.path.dirname(filename) or "."
    newest = newest_complete_checkpoint(save_dir, min(known, default=0), base_suffix)
    fix = (f"resume with --restore-file {newest}" if newest else
           f"move the {checkpoint_name(filename)} files out of {save_dir} to start fresh")
    raise TsConfigError(f"the ranks' checkpoint files are from different updates ({shown}; a run stopped while "
                        f"saving): {fix}")


def restore_from_record(extra_state: dict | None, model: torch.nn.Module, tensor_size: int, filename: str,
                        reset_optimizer: bool) -> None:
    """After fairseq loaded ``filename``: refuse optimizer state recorded in another parameter order
    (before any step: moments given to other parameters never update one), and restore the RNG
    tracker saved at the same tensor-parallel size."""
    saved = (extra_state or {}).get(RECORD_KEY) or {}
    if not reset_optimizer:
        check_optimizer_order(saved.get("params"), model, filename)
    if saved.get("size") == tensor_size and saved.get("rng"):
        get_rng_tracker().load_state_dict(saved["rng"])
