"""CUDA graphs of a decoder stack's training step (``--ts-cuda-graphs``): each layer's forward and
backward are captured once by ``torch.cuda.make_graphed_callables`` at the first training batch's
shape, in one memory pool (forward 1..L, then backward L..1, the order a step runs them), and
replayed after: per layer and direction one graph launch and one copy of its input (or incoming
gradient) into the graph's static buffer, instead of each of the layer's kernels from Python.

Replays read the parameters where they are, so optimizer steps in place are seen. What does not
fit a graph runs the layers as they are: evaluation, no-grad passes, another shape than the
captured one (one log line the first time), a batch with a padding or document mask, position
bias or memory. A replay overwrites its static buffers, gradients included, and autograd may keep
a static gradient as a parameter's ``.grad``; so before the graphs run again with gradients
already accumulated (``--update-freq`` > 1), those gradients are copied out. The pool keeps one
batch's activations and gradients for the whole run; a batch of another shape allocates its own.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.errors import TsConfigError

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
    """``torch.cuda.make_graphed_callables`` over the layers in one pool (unused parameters allowed),
    capturing in ``thread_local`` error mode: fairseq's loader threads pin the next batches meanwhile,
    which the default ``global`` mode turns into a failed capture. ``make_graphed_callables`` takes
    the mode from PyTorch PR 188832 (July 2026) on; before it, its ``torch.cuda.graph`` is given it."""
    if "capture_error_mode" in inspect.signature(torch.cuda.make_graphed_callables).parameters:
        return torch.cuda.make_graphed_callables(steps, samples, allow_unused_input=True,
                                                 capture_error_mode="thread_local")
    graph = torch.cuda.graph
    torch.cuda.graph = functools.partial(graph, capture_error_mode="thread_local")
    try:
        return torch.cuda.make_graphed_callables(steps, samples, allow_unused_input=True)
    finally:
        torch.cuda.graph = graph


def check_graphable(cfg: StackConfig) -> None:
    """What ``LayerStep`` cannot capture, refused in one line when the stack is built (a model that
    trained with graphs passed, so its checkpoint builds anywhere: the run's own limits are the
    trainer's, :func:`~torchscale_fairseq.integration.host_overhead.check_cuda_graphs`)."""
    clashes = [
        (cfg.moe is not None, "does not capture MoE layers (their routing statistics leave the layer every step): "
                              "drop the flag or --moe-expert-count"),
        (cfg.checkpoint_activations or cfg.selective_recompute,
         "cannot capture --checkpoint-activations' recomputation: drop one of the two flags"),
        (cfg.rel_pos_buckets > 0, "captures layers without a position bias: use --xpos or --rel-pos-buckets 0"),
    ]
    why = next((why for clash, why in clashes if clash), None)
    if why is not None:
        raise TsConfigError(f"--ts-cuda-graphs {why}")


class GraphedLayers:
    """The captured layers of one stack; plain object, so the model's parameter names stay its own.
    ``dynamic_batch``: the samples' first dimension marked dynamic, as the stack marks its input for
    ``--ts-compile``, so that the captured and the uncaptured passes run one compiled graph."""

    def __init__(self, capture: Capture = make_graphed_layers, dynamic_batch: bool = False) -> None:
        self.capture = capture
        self.dynamic_batch = dynamic_batch
        self.shape: Optional[torch.Size] = None
        self.layers: tuple[nn.Module, ...] = ()
        self.steps: tuple[nn.Module, ...] = ()
        self.params: list[nn.Parameter] = []
        self.copied: dict[nn.Parameter, int] = {}  # parameter: address of the gradient copied out last
        self.told_shape = False

    def __deepcopy__(self, memo: dict) -> "GraphedLayers":
        """A copy of the model (``--ema``) captures its own graphs if it ever trains."""
        return GraphedLayers(self.capture, self.dynamic_batch)

    def __call__(self, layers: Sequence[nn.Module], x: torch.Tensor) -> Optional[torch.Tensor]:
        """The stack's output through the graphs, or ``None`` where they do not apply (the caller then
        runs the layers). The caller has checked that the batch has no masks, bias or memory."""
        if not (torch.is_grad_enabled() and all(layer.training for layer in layers)):
            return None
        if self.shape is None:
            self.steps = self.capture(tuple(LayerStep(layer) for layer in layers),
                                      tuple((self._sample(x, i),) for i in range(len(layers))))
            self.shape, self.layers = x.shape, tuple(layers)
            self.params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
            logger.info("--ts-cuda-graphs: %d layers captured at input shape %s", len(layers), tuple(x.shape))
        elif len(layers) != len(self.layers) or any(a is not b for a, b in zip(layers, self.layers)):
            return None
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

    def _sample(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Layer ``i``'s static input: a copy of ``x`` (every layer's after the first needs a gradient)."""
        sample = x.detach().clone().requires_grad_(x.requires_grad or i > 0)
        if self.dynamic_batch:
            torch._dynamo.maybe_mark_dynamic(sample, 0)
        return sample
