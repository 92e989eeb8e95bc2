"""Where a batch's pads are, found on the host before the batch goes to the device (the trainer's
``_prepare_sample``), so that a stack's forward chooses its masks without reading the device:

- ``NONE``: no pad; no mask;
- ``TRAILING``: pads only after each row's last real token; causal self-attention needs no mask
  for them (no real token attends to a later position, and the loss ignores pad targets), MoE
  routing and bidirectional attention do;
- ``INTERIOR``: a pad before a real token (left padding); every mask.

A tensor carries its layout as an attribute; one without it (built elsewhere, or a copy) is
tested on the device, as before."""

from __future__ import annotations

import torch

NONE, TRAILING, INTERIOR = "none", "trailing", "interior"
_ATTRIBUTE = "ts_padding_layout"


def padding_layout(tokens: torch.Tensor, pad: int) -> str:
    """The layout of ``tokens`` (B, T) padded with ``pad`` (reads ``tokens``: call it on the host)."""
    pads = tokens.eq(pad)
    if not bool(pads.any()):
        return NONE
    return INTERIOR if bool((pads[:, :-1] & ~pads[:, 1:]).any()) else TRAILING


def mark_padding_layout(tokens: torch.Tensor, layout: str) -> torch.Tensor:
    setattr(tokens, _ATTRIBUTE, layout)
    return tokens


def known_padding_layout(tokens: torch.Tensor) -> str | None:
    """The layout marked on ``tokens``, or ``None``."""
    return getattr(tokens, _ATTRIBUTE, None)


def after_padding(layout: str | None, grew: bool) -> str | None:
    """The layout once pads were appended to every row (``grew``: to a multiple of a parallel size)."""
    return TRAILING if layout == NONE and grew else layout
