"""Choice flags read from fairseq's model config."""

from __future__ import annotations

from typing import Any


def choice(args: Any, name: str, default: str) -> str:
    """Choice flag ``name`` of ``args`` (``default`` where absent) as a plain ``str``. fairseq-train's typed
    config holds a choice as a ``ChoiceEnum`` member, which equals its string in Python but not in torch
    2.11's ``torch.compile`` (it traces ``member == "gelu"`` as False), nor for torchao's recipe names."""
    return str(getattr(args, name, default))
