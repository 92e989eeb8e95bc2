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

An MoE layer (expert-parallel size 1, grouped expert GEMMs: its forward reads nothing on the host)
is captured with its auxiliary losses: its micro-batch's :class:`~torchscale_fairseq.modules.moe.
aux_loss.AuxLossScale` gradients are static inputs copied in at each replay, and its balance loss,
router z-loss and routing statistics are static outputs, read by the criterion in the micro-batch's
forward (the next replay overwrites them). The warm-up passes of the capture count no expert loads.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import fields, replace
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.moe.balance import MoEAux, RoutingStats
from torchscale_fairseq.modules.moe.layer import MoELayer

logger = logging.getLogger(__name__)

Capture = Callable[[tuple[nn.Module, ...], tuple[tuple[torch.Tensor, ...], ...]], tuple[nn.Module, ...]]


def moe_layer(layer: nn.Module) -> Optional[MoELayer]:
    """The MoE FFN of a transformer layer (``None``: a dense one)."""
    ffn = getattr(layer, "ffn", None)
    return ffn if isinstance(ffn, MoELayer) else None


class LayerStep(nn.Module):
    """What is captured of one layer: ``x -> layer(x, causal=True)[0]`` (a causal layer without
    masks, bias or memory). An MoE layer's step is ``(x, balance, z) -> (y, balance_loss, z_loss,
    *routing statistics)``: ``balance`` and ``z`` the gradients of its auxiliary losses
    (:class:`~torchscale_fairseq.modules.moe.aux_loss.AuxLossScale`), the losses and statistics
    detached (their gradients reach the router through ``y``'s backward, ``MoEAuxLossAutoScaler``)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, *scale: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        moe = moe_layer(self.layer)
        if moe is None:
            return self.layer(x, causal=True)[0]
        outer = moe.aux_loss_scale
        moe.aux_loss_scale = replace(outer, balance=scale[0], z=scale[1])
        try:
            y, aux = self.layer(x, causal=True)
        finally:
            moe.aux_loss_scale = outer
        stats = (getattr(aux.stats, field.name) for field in fields(RoutingStats))
        return (y, *(t.detach() for t in (aux.balance_loss, aux.z_loss, *stats)))


def make_graphed_layers(steps: tuple[nn.Module, ...], samples: tuple[tuple[torch.Tensor, ...], ...]
                        ) -> tuple[nn.Module, ...]:
    """``torch.cuda.make_graphed_callables`` over the layers in one pool (unused parameters allowed),
    capturing in ``thread_local`` error mode: fairseq's loader threads pin the next batches meanwhile,
    which the default ``global`` mode turns into a failed capture. ``make_graphed_callables`` takes
    the mode from PyTorch PR 188832 (July 2026) on; before it, its ``torch.cuda.graph`` is given it.
    An MoE layer whose experts run one GEMM per expert (they read their row counts on the host) is
    refused in one line."""
    for step, (x, *_) in zip(steps, samples):
        moe = moe_layer(step.layer)
        if moe is not None and not moe.experts.runs_grouped(x):
            raise TsConfigError(
                f"--ts-cuda-graphs captures MoE layers whose experts run grouped GEMMs (torch._grouped_mm: a GPU of "
                f"compute capability 9.0 or more, --bf16, expert widths multiple of 8), and layer {moe.tag!r} runs one "
                f"GEMM per expert on {x.device.type} in {str(x.dtype).removeprefix('torch.')}, which reads its row "
                "counts on the host: train in bf16 on such a GPU or drop --ts-cuda-graphs")
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

    def __call__(self, layers: Sequence[nn.Module], x: torch.Tensor
                 ) -> Optional[tuple[torch.Tensor, list[MoEAux]]]:
        """The stack's output through the graphs and its MoE layers' auxiliary outputs, or ``None``
        where the graphs do not apply (the caller then runs the layers). The caller has checked that
        the batch has no masks, bias or memory."""
        if not (torch.is_grad_enabled() and all(layer.training for layer in layers)):
            return None
        moes = [moe_layer(layer) for layer in layers]
        if any(moe is not None and moe.aux_loss_scale is None for moe in moes):
            return None  # a forward outside the trainer's step: no auxiliary-loss gradients to replay
        if self.shape is None:
            self._capture(layers, moes, x)
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
        aux = []
        for step, moe in zip(self.steps, moes):
            if moe is None:
                x = step(x)
                continue
            scale = moe.aux_loss_scale
            x, balance_loss, z_loss, *stats = step(x, scale.balance, scale.z)
            aux.append(MoEAux(balance_loss, z_loss, RoutingStats(*stats), scale, moe.tag))
        return x, aux

    def _capture(self, layers: Sequence[nn.Module], moes: list[Optional[MoELayer]], x: torch.Tensor) -> None:
        """Capture the layers at ``x``'s shape; the capture's warm-up passes leave the expert loads as they were."""
        loads = [(moe.expert_load, moe.expert_load.clone()) for moe in moes
                 if moe is not None and moe.expert_load is not None]
        samples = tuple((self._sample(x, i),) if moe is None else
                        (self._sample(x, i), moe.aux_loss_scale.balance.clone(), moe.aux_loss_scale.z.clone())
                        for i, moe in enumerate(moes))
        self.steps = self.capture(tuple(LayerStep(layer) for layer in layers), samples)
        for load, before in loads:
            load.copy_(before)
        self.shape, self.layers = x.shape, tuple(layers)
        self.params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        logger.info("--ts-cuda-graphs: %d layers captured at input shape %s", len(layers), tuple(x.shape))

    def _sample(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Layer ``i``'s static input: a copy of ``x`` (every layer's after the first needs a gradient)."""
        sample = x.detach().clone().requires_grad_(x.requires_grad or i > 0)
        if self.dynamic_batch:
            torch._dynamo.maybe_mark_dynamic(sample, 0)
        return sample
