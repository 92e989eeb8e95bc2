"""A non-finite gradient norm skips the update in every precision mode.

Stock fairseq skips it under fp16 (the loss scaler raises ``OverflowError``) and AMP,
but in fp32 raises ``FloatingPointError``, writes ``crash.pt`` and stops training. We
turn a non-finite fp32 norm into the same ``OverflowError`` path: the update is skipped
and logged ("gradient overflow detected, ignoring gradient"), no parameter changes, and
training goes on. The fp16 loss scaler still sees the overflow first and adapts.
"""

from __future__ import annotations

import torch
from fairseq.trainer import Trainer

_stock_clip_grad_norm = Trainer.clip_grad_norm


def clip_grad_norm(self: Trainer, clip_norm: float) -> torch.Tensor:
    grad_norm = _stock_clip_grad_norm(self, clip_norm)
    if not self.cfg.common.amp and not bool(torch.isfinite(grad_norm).all()):
        raise OverflowError(f"non-finite gradient norm {float(grad_norm)}: update skipped")
    return grad_norm


def patch_nonfinite_skip() -> None:
    Trainer.clip_grad_norm = clip_grad_norm
