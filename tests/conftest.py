"""Shared pytest fixtures: the repository root on ``sys.path`` (for ``data_prep``) and the
tiny binarised corpora every CLI test reads."""

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


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory) -> Path:
    """Tiny binarised monolingual data, built once per session; tests only read it."""
    from tests.cli_utils import make_lm_data

    return make_lm_data(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="session")
def mt_data(tmp_path_factory) -> Path:
    """Tiny binarised parallel data (joined dictionary), built once per session; tests only read it."""
    from tests.cli_utils import make_mt_data

    return make_mt_data(tmp_path_factory.mktemp("mt"))
