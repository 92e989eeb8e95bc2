"""Model construction that does not depend on the default device.

Every random draw (and every computed table) of model construction happens on the CPU, from the
CPU generators, and the result is then moved to the default device (``torch.set_default_device``
or a ``with torch.device(...)`` block). So a model built under a CUDA default device holds the
values its CPU build holds for the same seed, one built under ``meta`` has their shapes, both
consume the CPU generator exactly as the CPU build does, and no CPU ``torch.Generator`` meets a
factory call on another device (CUDA refuses: "Expected a 'cuda' device type for generator").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


def target_device() -> torch.device:
    """The default device, with the index a bare ``cuda`` resolves to."""
    device = torch.get_default_device()
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def on_default_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` (made on the CPU) on the default device; ``t`` itself when that is the CPU."""
    return t.to(target_device())


def move_to(device: torch.device, *modules: nn.Module) -> None:
    """Move the parameters and buffers of ``modules`` to ``device`` in place, also where the
    tensor type changes (CPU to ``meta``, where ``Module.to`` would make a new parameter per
    use): a parameter shared by several submodules stays one parameter, with its attributes."""
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (old, new): old kept alive

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:
            if t.device == device:
                new = t
            elif isinstance(t, nn.Parameter):
                new = nn.Parameter(t.detach().to(device), requires_grad=t.requires_grad)
                new.__dict__.update(t.__dict__)
            else:
                new = t.to(device)
            moved[id(t)] = (t, new)
        return moved[id(t)][1]

    for module in modules:
        for sub in module.modules():
            for store in (sub._parameters, sub._buffers):
                for key, t in store.items():
                    if t is not None:
                        store[key] = convert(t)


@contextlib.contextmanager
def cpu_construction(module: nn.Module) -> Iterator[None]:
    """Build (part of) ``module`` in the block with the CPU as default device; on leaving it,
    move all of ``module``'s parameters and buffers to the default device outside the block."""
    device = target_device()
    with torch.device("cpu"):
        yield
    move_to(device, module)


def build_on_cpu(factory: Callable[[], T]) -> T:
    """``factory()`` with the CPU as default device; the module it returns (or each module of
    the tuple it returns, sharing parameters across them) moved to the default device."""
    device = target_device()
    with torch.device("cpu"):
        built = factory()
    modules = built if isinstance(built, tuple) else (built,)
    move_to(device, *[m for m in modules if isinstance(m, nn.Module)])
    return built
