"""Upstream incompatibility (fairseq 0.12.2, fairseq-fixed 0.12.3.1 with PyTorch >= 2.6):
checkpoints load with ``torch.load(weights_only=True)``, the default since PyTorch 2.6.

fairseq stores a few plain Python/NumPy objects besides tensors (``argparse.Namespace``
in older-style configs, NumPy scalars in meters and ``best_*`` values) and, when it sends a
loaded checkpoint from rank 0 to the other ranks, OmegaConf containers. They are added
to an explicit allow-list; ``weights_only`` is never disabled, so a checkpoint whose
pickle names anything else (e.g. ``os.system``) is refused before any code runs.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import typing
from typing import List

import numpy as np
import torch


def allowed_globals() -> List[object]:
    from fairseq.distributed.utils import _TensorPlaceholder
    from omegaconf import DictConfig, ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode

    allowed: List[object] = [argparse.Namespace, collections.OrderedDict, collections.defaultdict, np.dtype]
    # fairseq broadcasts the loaded state (its config as a DictConfig) from rank 0 through torch.load
    allowed += [DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode, typing.Any, dict, list, int]
    # ... with its tensors sent apart, each replaced by an index (a frozen dataclass of one int)
    allowed.append(_TensorPlaceholder)
    # numpy >= 1.26 has the module (1.26's np._core does not import it; its scalar names numpy.core)
    allowed.append(importlib.import_module("numpy._core.multiarray").scalar)
    for name in ("Float64DType", "Float32DType", "Int64DType", "Int32DType", "BoolDType"):
        dtype_cls = getattr(getattr(np, "dtypes", None), name, None)
        if dtype_cls is not None:
            allowed.append(dtype_cls)
    return allowed


def register_safe_globals() -> None:
    torch.serialization.add_safe_globals(allowed_globals())
