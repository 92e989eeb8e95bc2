"""Shared fixtures of the optimizer tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_utils import make_lm_data


@pytest.fixture(scope="session")
def moe_lm_data(tmp_path_factory) -> Path:
    return make_lm_data(tmp_path_factory.mktemp("optim_lm"))
