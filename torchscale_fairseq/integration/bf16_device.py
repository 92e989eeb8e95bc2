"""``--bf16`` off TPUs: fairseq 0.12 turns ``--bf16`` into ``--tpu`` (``options.py``), and
``--tpu`` sends the trainer and the distributed setup to ``torch_xla``. Where ``torch_xla``
is not installed the flag is cleared again, so bf16 trains on the device fairseq would
otherwise pick (CUDA, or the CPU with ``--cpu``)."""

from __future__ import annotations

import importlib.util
from typing import Any

from omegaconf import open_dict


def bf16_without_tpu(cfg: Any) -> None:
    """Clear ``cfg.common.tpu`` when it only comes from ``--bf16`` and there is no ``torch_xla``."""
    common = cfg.common
    if common.bf16 and common.tpu and importlib.util.find_spec("torch_xla") is None:
        with open_dict(cfg):
            common.tpu = False
