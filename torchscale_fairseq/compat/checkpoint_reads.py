"""A checkpoint that cannot be read (corrupt, truncated, or naming objects outside the
``weights_only`` allow-list) stops with one line naming the file and what to do."""

from __future__ import annotations

import os
import traceback

import torch.serialization
from fairseq import checkpoint_utils

from torchscale_fairseq.errors import TsConfigError

_TORCH_SERIALIZATION = os.path.abspath(torch.serialization.__file__)


def _raised_in_torch_load(exc: BaseException) -> bool:
    """Whether the exception came from inside ``torch.load`` (the file, not fairseq)."""
    return any(os.path.abspath(frame.filename) == _TORCH_SERIALIZATION
               for frame in traceback.extract_tb(exc.__traceback__))


def _wrap(load):
    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        try:
            return load(path, arg_overrides, load_on_all_ranks)
        except TsConfigError:
            raise
        except Exception as e:
            if not _raised_in_torch_load(e):
                raise
            text = str(e)
            if "Weights only load failed" in text and "GLOBAL" in text:
                detail = next((ln.strip() for ln in text.splitlines() if "GLOBAL" in ln), "")
                raise TsConfigError(
                    f"refused to load {path}: it needs objects outside the safe allow-list ({detail}); "
                    "only load checkpoints from sources you trust, re-saved as plain tensors"
                ) from e
            first_line = (text.splitlines() or [type(e).__name__])[0][:120]
            raise TsConfigError(
                f"checkpoint {path} is corrupt or truncated ({type(e).__name__}: {first_line}): "
                "restore it from a copy or remove it to start fresh"
            ) from e

    load_checkpoint_to_cpu.__wrapped__ = load
    return load_checkpoint_to_cpu


def patch_checkpoint_reads() -> None:
    """Wrap whatever loader is installed now (call after the other checkpoint patches)."""
    checkpoint_utils.load_checkpoint_to_cpu = _wrap(checkpoint_utils.load_checkpoint_to_cpu)
