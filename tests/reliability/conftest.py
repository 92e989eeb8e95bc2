from pathlib import Path

import pytest

from tests.cli_utils import make_lm_data, make_mt_data


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory) -> Path:
    return make_lm_data(tmp_path_factory.mktemp("rel_lm"))


@pytest.fixture(scope="session")
def mt_data(tmp_path_factory) -> Path:
    return make_mt_data(tmp_path_factory.mktemp("rel_mt"))
