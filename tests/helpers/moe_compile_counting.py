"""The MoE layer's own compiled functions (``--moe-compiled-routing``, ``--moe-compiled-experts``) on a counted
``aot_eager``, for tests that compare them with the eager layer."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from torchscale_fairseq.modules.moe import layer as moe_layer


class CountingBackend:
    """``aot_eager``, counting the graphs it compiles (``frames``) and the calls of them (``calls``)."""

    def __init__(self) -> None:
        self.frames = self.calls = 0

    def __call__(self, graph, example_inputs):
        self.frames += 1
        compiled = lookup_backend("aot_eager")(graph, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)
        return run


@contextmanager
def counted_moe_compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingBackend]:
    """The layer's compiled functions on a :class:`CountingBackend`, dynamo's caches fresh before and dropped
    after; a graph past the recompile limit fails the test instead of running eager unseen."""
    backend = CountingBackend()
    monkeypatch.setattr(moe_layer, "COMPILE_BACKEND", backend)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield backend
    torch._dynamo.reset()
