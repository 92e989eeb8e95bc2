"""``--sequence-parallel`` where it cannot work is one line before any model is built."""

import pytest

from tests.helpers.model_utils import build
from torchscale_fairseq.errors import TsConfigError


def test_sequence_parallel_needs_tensor_parallelism():
    with pytest.raises(TsConfigError, match=r"needs --model-parallel-size > 1"):
        build("lm", sequence_parallel=True)


def test_sequence_parallel_with_moe_layers_needs_tensor_parallelism():
    with pytest.raises(TsConfigError, match=r"needs --model-parallel-size > 1"):
        build("lm", sequence_parallel=True, moe_expert_count=4)
