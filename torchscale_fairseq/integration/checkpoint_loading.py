"""What fairseq's checkpoint loader refuses, in one line, before any weight is copied.

- A file that cannot be read (corrupt, truncated, or naming objects outside the
  ``weights_only`` allow-list of :mod:`torchscale_fairseq.compat.safe_checkpoints`)
  names the file and what to do. Errors are told apart by where they were raised
  (inside ``torch.load``: the file), not by their wording.
- Parts saved at another tensor-parallel size or pipeline size name the resharding tool, as
  do part names that do not match ``--model-parallel-size`` and pipeline stages given to a
  single-stage tool; expert shards where this process
  uses another number of them (e.g. one shard given to a single-process
  ``fairseq-eval-lm``) name the consolidation tool (the checks of
  :mod:`torchscale_fairseq.checkpoints.layout`).

fairseq calls these functions without an object that could keep the run's parallel context, when
it loads a model or resumes (a factory seam, like a model's build, never a training step), so they
read the context the edge handed over
(:func:`~torchscale_fairseq.model_parallel.parallel_context.current_parallel_context`).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.serialization
from fairseq import checkpoint_utils

from torchscale_fairseq.checkpoints.layout import (
    check_checkpoint_name,
    check_expert_shards,
    check_pipeline_size,
    check_tensor_parallel_size,
    read_record,
)
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.parallel_context import current_parallel_context

STOCK_LOAD = checkpoint_utils.load_checkpoint_to_cpu
STOCK_FILENAME = checkpoint_utils.get_maybe_sharded_checkpoint_filename
_TORCH_SERIALIZATION = os.path.abspath(torch.serialization.__file__)


def _raised_in_torch_load(exc: BaseException) -> bool:
    """Whether the exception came from inside ``torch.load`` (the file, not fairseq)."""
    return any(os.path.abspath(entry.filename) == _TORCH_SERIALIZATION
               for entry in traceback.extract_tb(exc.__traceback__))


def _unreadable(path: str, e: Exception) -> TsConfigError:
    text = str(e)
    if "Weights only load failed" in text and "GLOBAL" in text:
        detail = next((ln.strip() for ln in text.splitlines() if "GLOBAL" in ln), "")
        return TsConfigError(
            f"refused to load {path}: it needs objects outside the safe allow-list ({detail}); "
            "only load checkpoints from sources you trust, re-saved as plain tensors"
        )
    first_line = (text.splitlines() or [type(e).__name__])[0][:120]
    return TsConfigError(
        f"checkpoint {path} is corrupt or truncated ({type(e).__name__}: {first_line}): "
        "restore it from a copy or remove it to start fresh"
    )


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """fairseq's loader with the checks of the module docstring."""
    try:
        state = STOCK_LOAD(path, arg_overrides, load_on_all_ranks)
    except TsConfigError:
        raise
    except Exception as e:
        if _raised_in_torch_load(e):
            raise _unreadable(path, e) from e
        raise
    parallel = current_parallel_context()
    check_tensor_parallel_size(state, path, parallel.tensor_size)
    check_pipeline_size(state, path, parallel.pipeline_size)
    if read_record(state).experts > 0:  # experts are sharded over the data-context ranks when there are several
        check_expert_shards(state, path, parallel.data_context_size)
    return state


def read_checkpoint_file(path: str) -> dict[str, Any]:
    """``torch.load`` of one checkpoint file (weights only, on CPU) with the one-line
    errors of the module docstring (for the conversion commands)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise _unreadable(path, e) from e


def get_maybe_sharded_checkpoint_filename(filename: str, suffix: str, shard_idx: int, num_shards: int) -> str:
    """fairseq's file name resolution plus clear errors for the part/size mix-ups."""
    resolved = STOCK_FILENAME(filename, suffix, shard_idx, num_shards)
    if os.path.exists(resolved) or not filename.endswith(".pt"):
        return resolved
    check_checkpoint_name(filename, current_parallel_context().tensor_size)
    return resolved
