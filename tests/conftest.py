"""Shared pytest fixtures: the repository root on ``sys.path`` (for ``data_prep``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (holds ``torchscale_fairseq/``, ``data_prep/`` and ``scripts/``)."""
    return REPO_ROOT
