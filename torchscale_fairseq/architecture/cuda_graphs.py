"""CUDA graphs of a decoder stack's training step (``--ts-cuda-graphs``): each layer's forward and
backward are captured once by ``torch.cuda.make_graphed_callables`` at the first training batch's
shape, in one memory pool (forward 1..L, then backward L..1, the order a step runs them), and
replayed after: one launch per layer and direction instead of each of its kernels from Python.

Replays read the parameters where they are, so optimizer steps in place are seen. What does not
fit a graph runs the layers as they are: evaluation, no-grad passes, another shape than the
captured one (one log line the first time), a batch with a padding or document mask, position
bias or memory. A replay overwrites its static buffers, gradients included, and autograd may keep
a static gradient as a parameter's ``.grad``; so before the graphs run again with gradients
already accumulated (``--update-freq`` > 1), those gradients are copied out.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)

Capture = Callable[[tuple[nn.Module, ...], tuple[tuple[torch.Tensor, ...], ...]], tuple[nn.Module, ...]]


class LayerStep(nn.Module):
    """What is captured of one layer: ``x -> layer(x, causal=True)[0]`` (a causal layer without
    masks, bias or memory)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, causal=True)[0]


def make_graphed_layers(steps: tuple[nn.Module, ...], samples: tuple[tuple[torch.Tensor, ...], ...]
                        ) -> tuple[nn.Module, ...]:
    """``torch.cuda.make_graphed_callables`` over the layers in one pool (unused parameters allowed)."""
    return torch.cuda.make_graphed_callables(steps, samples, allow_unused_input=True)


class GraphedLayers:
    """The captured layers of one stack; plain object, so the model's parameter names stay its own."""

    def __init__(self, capture: Capture = make_graphed_layers) -> None:
        self.capture = capture
        self.shape: Optional[torch.Size] = None
        self.steps: tuple[nn.Module, ...] = ()
        self.params: list[nn.Parameter] = []
        self.copied: dict[nn.Parameter, int] = {}  # parameter: address of the gradient copied out last
        self.told_shape = False

    def __deepcopy__(self, memo: dict) -> "GraphedLayers":
        """A copy of the model (``--ema``) captures its own graphs if it ever trains."""
        return GraphedLayers(self.capture)

    def __call__(self, layers: Sequence[nn.Module], x: torch.Tensor) -> Optional[torch.Tensor]:
        """The stack's output through the graphs, or ``None`` where they do not apply (the caller then
        runs the layers). The caller has checked that the batch has no masks, bias or memory."""
        if not (torch.is_grad_enabled() and all(layer.training for layer in layers)):
            return None
        if self.shape is None:
            self.steps = self.capture(tuple(LayerStep(layer) for layer in layers),
                                      tuple((x.detach().clone().requires_grad_(x.requires_grad),) for _ in layers))
            self.shape = x.shape
            self.params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
            logger.info("--ts-cuda-graphs: %d layers captured at input shape %s", len(layers), tuple(x.shape))
        elif x.shape != self.shape:
            if not self.told_shape:
                logger.info("--ts-cuda-graphs: a batch of shape %s ran without the graphs (captured at %s)",
                            tuple(x.shape), tuple(self.shape))
                self.told_shape = True
            return None
        for p in self.params:  # a static gradient kept as .grad would be overwritten by the next replay
            if p.grad is not None and self.copied.get(p) != p.grad.data_ptr():
                p.grad = p.grad.clone()
                self.copied[p] = p.grad.data_ptr()
        for step in self.steps:
            x = step(x)
        return x

