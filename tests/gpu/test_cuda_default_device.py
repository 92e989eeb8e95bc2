"""Built under a CUDA default device (``torch.set_default_device("cuda")``, as
``tests/workers/layer_worker.py ... cuda`` builds), every model of
``tests/test_device_init.py`` (ts_lm with X-MoE at tensor-parallel size 1 first)
holds bit for bit the parameters and buffers of its CPU build with the same seed, on the GPU, and
consumes the CPU generator as the CPU build does (``device_init.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.test_device_init import MODELS, build_seeded

pytestmark = pytest.mark.gpu


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, less fairseq's uninitialised ``_float_tensor`` device markers."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: t for name, t in named if not name.endswith("_float_tensor")}


@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_default_device_builds_the_cpu_weights(name):
    kind, overrides = MODELS[name]
    cpu, cpu_rng = build_seeded(kind, overrides)
    with torch.device("cuda"):
        gpu, gpu_rng = build_seeded(kind, overrides)
    want, got = tensors(cpu), tensors(gpu)
    assert got.keys() == want.keys()
    for key, t in got.items():
        assert t.device.type == "cuda", key
        assert torch.equal(t.cpu(), want[key]), f"{key} differs from the CPU build"
    assert torch.equal(gpu_rng, cpu_rng), "a draw happened on the GPU instead of the CPU"
