"""Tiny binarised data sets shared by the MoE tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_utils import make_lm_data, make_mt_data


@pytest.fixture(scope="session")
def moe_lm_data(tmp_path_factory) -> Path:
    return make_lm_data(tmp_path_factory.mktemp("moe_lm"))


@pytest.fixture(scope="session")
def moe_mt_data(tmp_path_factory) -> Path:
    return make_mt_data(tmp_path_factory.mktemp("moe_mt"))
