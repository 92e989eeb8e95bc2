"""Upstream bug (fairseq 0.12.2, fairseq-fixed 0.12.3.1, with NumPy >= 2): fairseq uses
``np.compat.long`` (token blocks with ``--sample-break-mode eos``, which the LM hub's
``generate()`` always uses; bucketed language-pair batches), and NumPy 2 removed
``numpy.compat``. We provide the one name fairseq needs."""

from __future__ import annotations

import types

import numpy as np


def patch_numpy_compat() -> None:
    if "compat" not in vars(np):
        np.compat = types.SimpleNamespace(long=np.int64)
