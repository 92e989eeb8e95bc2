"""Refuse checkpoint parts saved at another tensor-parallel size, in one line naming the
resharding tool, before any weight is copied.

A part records its size in the saved config (``cfg.common.model_parallel_size``, kept up
to date by ``ts-reshard``); fairseq looks for ``NAME-model_part-{rank}.pt`` when
``N > 1`` and ``NAME.pt`` when ``N = 1``, so a missing file whose other form exists is
the same mistake.
"""

from __future__ import annotations

import os
import re
from typing import Any

from fairseq import checkpoint_utils

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.process_groups import (
    get_tensor_parallel_world_size,
)

PART_SUFFIX = "-model_part-"
_STOCK_LOAD = checkpoint_utils.load_checkpoint_to_cpu
_STOCK_FILENAME = checkpoint_utils.get_maybe_sharded_checkpoint_filename


def saved_model_parallel_size(state: dict[str, Any]) -> int:
    """The tensor-parallel size a loaded checkpoint was saved at (1 when unrecorded)."""
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("common") is not None:
        return int(cfg["common"].get("model_parallel_size", 1) or 1)
    args = state.get("args")
    return int(getattr(args, "model_parallel_size", 1) or 1)


def _reshard_hint(path: str, saved: int, wanted: int) -> str:
    base = re.sub(rf"{PART_SUFFIX}\d+\.pt$", ".pt", path)
    return (
        f"{path} was saved at --model-parallel-size {saved} but this run uses {wanted}: "
        f"reshard it first with `ts-reshard --input {base} --size {wanted} --output NEW.pt` (then use NEW.pt)"
    )


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """fairseq's loader plus the size check."""
    state = _STOCK_LOAD(path, arg_overrides, load_on_all_ranks)
    saved, wanted = saved_model_parallel_size(state), get_tensor_parallel_world_size()
    if saved != wanted:
        raise TsConfigError(_reshard_hint(path, saved, wanted))
    return state


def get_maybe_sharded_checkpoint_filename(filename: str, suffix: str, shard_idx: int, num_shards: int) -> str:
    """fairseq's file name resolution plus clear errors for the part/size mix-ups."""
    resolved = _STOCK_FILENAME(filename, suffix, shard_idx, num_shards)
    if os.path.exists(resolved) or not filename.endswith(".pt"):
        return resolved
    wanted = get_tensor_parallel_world_size()
    if PART_SUFFIX in os.path.basename(filename):
        raise TsConfigError(
            f"{filename} names one checkpoint part: pass the name without '{PART_SUFFIX}K' "
            "(fairseq appends each rank's part suffix itself)"
        )
    if wanted > 1 and os.path.exists(filename):
        raise TsConfigError(_reshard_hint(filename, 1, wanted))
    part0 = filename[:-3] + f"{PART_SUFFIX}0.pt"
    if wanted == 1 and os.path.exists(part0):
        saved = 1
        while os.path.exists(filename[:-3] + f"{PART_SUFFIX}{saved}.pt"):
            saved += 1
        raise TsConfigError(_reshard_hint(filename, saved, wanted))
    return resolved


def patch_checkpoint_loading() -> None:
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    checkpoint_utils.get_maybe_sharded_checkpoint_filename = get_maybe_sharded_checkpoint_filename
