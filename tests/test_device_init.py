"""Model construction does not depend on the default device (``device_init.py``).

Built under a ``meta`` default device (a non-CPU default device every machine has), every model
builds, every parameter and buffer lands on ``meta``, the parameters have the CPU build's names,
shapes and dtypes, and the build consumes the CPU generator exactly as the CPU build of the same
seed does: so every draw happened on the CPU (a draw on the default device would leave the CPU
generator behind), and the CUDA build holds the CPU build's values (checked bit for bit on a GPU:
``tests/gpu/test_cuda_default_device.py``). :class:`GeneratorDeviceCheck` refuses, as CUDA does, a
generator of another device type than the tensor it fills ("Expected a 'cuda' device type for
generator", the error the X-MoE experts raised under a CUDA default device).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.helpers.model_utils import build, dictionary
from torchscale_fairseq.device_init import build_on_cpu, move_to

MOE = dict(moe_expert_count=4, moe_freq=1)
# (kind, overrides): ts_lm with X-MoE at tensor-parallel size 1 first, then every other drawing module
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "lm-xmoe": ("lm", dict(MOE, moe_router="xmoe")),
    "lm-xmoe-swiglu-relpos": ("lm", dict(MOE, activation_fn="swiglu", rel_pos_buckets=8, decoder_learned_pos=True)),
    "lm-linear-router-noise-xpos": ("lm", dict(MOE, moe_router="linear", moe_gate_noise=1.0, xpos=True,
                                               backbone="deepnorm")),
    "lm-adaptive": ("lm", dict(adaptive_input=True, adaptive_softmax_cutoff="20,30", tie_adaptive_weights=True,
                               tie_adaptive_proj=True, share_decoder_input_output_embed=False)),
    "mt-moe": ("mt", dict(MOE, backbone="deepnorm", rel_pos_buckets=8)),
    "mlm": ("mlm", dict(backbone="preln")),
}


class GeneratorDeviceCheck(TorchFunctionMode):
    """Refuse a ``generator`` whose device type differs from the tensor the call makes or fills,
    as CUDA does (the CPU and ``meta`` accept any)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        generator = kwargs.get("generator")
        if generator is not None and isinstance(out, torch.Tensor) and out.device.type != generator.device.type:
            raise RuntimeError(f"Expected a '{out.device.type}' device type for generator but found "
                               f"'{generator.device.type}'")
        return out


def build_seeded(kind: str, overrides: dict[str, Any]):
    """The model built with seed 0 and the CPU generator state after building it."""
    torch.manual_seed(0)
    model = build(kind, dictionary(), **overrides)
    return model, torch.get_rng_state()


@pytest.mark.parametrize("name", list(MODELS))
def test_meta_default_device_builds_as_the_cpu(name):
    kind, overrides = MODELS[name]
    cpu, cpu_rng = build_seeded(kind, overrides)
    with torch.device("meta"), GeneratorDeviceCheck():
        meta, meta_rng = build_seeded(kind, overrides)
    got = {n: (tuple(p.shape), p.dtype) for n, p in meta.named_parameters()}
    assert got == {n: (tuple(p.shape), p.dtype) for n, p in cpu.named_parameters()}
    assert {n for n, _ in meta.named_buffers()} == {n for n, _ in cpu.named_buffers()}
    off_meta = [n for n, t in [*meta.named_parameters(), *meta.named_buffers()] if t.device.type != "meta"]
    assert not off_meta, f"not on the default device: {off_meta}"
    assert torch.equal(meta_rng, cpu_rng), "a draw happened on the default device instead of the CPU"


def test_generator_check_refuses_what_cuda_refuses():
    """The check stands in for CUDA: a CPU generator filling a ``meta`` tensor is refused."""
    with torch.device("meta"), GeneratorDeviceCheck(), pytest.raises(RuntimeError, match="device type for generator"):
        torch.randn(3, generator=torch.Generator())
    with GeneratorDeviceCheck():
        torch.randn(3, generator=torch.Generator())  # on the CPU: fine


def test_move_to_keeps_shared_parameters_and_attributes():
    """A parameter shared by two modules stays one (``Module.to('meta')`` would split it), with
    its attributes; the CPU draws are those of a plain CPU build."""

    def tied() -> tuple[torch.nn.Module, torch.nn.Module]:
        a = torch.nn.Linear(3, 4)
        b = torch.nn.Linear(3, 4)
        b.weight = a.weight
        a.weight.marked = True
        return a, b

    torch.manual_seed(0)
    ref_a, _ = tied()
    torch.manual_seed(0)
    with torch.device("meta"):
        a, b = build_on_cpu(tied)
    assert a.weight is b.weight and a.weight.device.type == "meta" and a.weight.marked
    assert a.bias.shape == ref_a.bias.shape and b.bias.device.type == "meta"
    cpu_a, _ = tied()
    move_to(torch.device("cpu"), cpu_a)  # on the device already: unchanged
    assert cpu_a.weight.marked and cpu_a.weight.device.type == "cpu"
