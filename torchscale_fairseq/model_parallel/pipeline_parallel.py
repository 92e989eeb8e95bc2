"""Pipeline parallelism: the layer split into stages, the point-to-point messages between
stages, and the executor that runs one rank's schedule (:mod:`.pipeline_schedules`).

Why not ``torch.distributed.pipelining``: its ``PipelineStage`` infers one activation shape
and reuses it for every micro-batch, and its schedules cut one batch into equal
micro-batches and apply ``loss_fn(output, target)`` to each; fairseq's micro-batches are the
``--update-freq`` batches of different shapes, and its criterion needs the whole sample
(targets, token counts, the MoE outputs). Every stage of a pipeline reads the same batches
(the data loader is sharded over data-parallel ranks only), so a stage has the tokens,
padding masks and positions of every micro-batch itself; only hidden states and their
gradients travel, each message a small header (dtype and shape) then the tensor. The
executor is as small as Megatron-LM's ``schedules.py``: buffered sends (``isend``, waited
at the end of the update) and blocking receives in the schedule's order, which
:func:`~.pipeline_schedules.simulate` checks to be free of deadlocks and in channel order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import pipeline_tied_role
from torchscale_fairseq.model_parallel.pipeline_schedules import Step, global_stage
from torchscale_fairseq.model_parallel.process_groups import group_size

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 7  # dtype index, ndim, up to 4 sizes, one integer the caller sends along


def parse_layer_counts(text: str | None) -> list[int] | None:
    """``--pipeline-layers "3,5"`` -> ``[3, 5]`` (``None`` when unset)."""
    if not text:
        return None
    try:
        return [int(n) for n in str(text).strip("[]").split(",")]
    except ValueError:
        raise TsConfigError(f"--pipeline-layers {text!r} is not a comma separated list of layer counts, e.g. 3,5") \
            from None


def stage_layer_counts(layers: int, stages: int, explicit: Sequence[int] | None = None) -> list[int]:
    """Layers per global stage: ``explicit`` (``--pipeline-layers``, one count >= 1 per stage) or an
    even split, refused in one line when the stages do not divide the layers."""
    if explicit is not None:
        if len(explicit) != stages or sum(explicit) != layers or min(explicit) < 1:
            raise TsConfigError(
                f"--pipeline-layers {','.join(map(str, explicit))} must give {stages} stage(s) (pipeline size x virtual "
                f"stages) at least one layer each, {layers} layers in all"
            )
        return list(explicit)
    if layers % stages != 0:
        raise TsConfigError(
            f"{layers} layers do not split evenly into {stages} pipeline stage(s) (pipeline size x virtual stages): "
            "set --pipeline-layers, e.g. " + ",".join(map(str, _near_even(layers, stages)))
        )
    return [layers // stages] * stages


def _near_even(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)] if base > 0 else [1] * stages


def chunk_layer_ranges(counts: Sequence[int], pipeline_size: int, pipeline_rank: int) -> list[range]:
    """The global layer indices of each chunk of ``pipeline_rank`` (chunk ``c`` is global stage
    ``c P + s``)."""
    starts = [sum(counts[:g]) for g in range(len(counts))]
    chunks = len(counts) // pipeline_size
    return [range(starts[g], starts[g] + counts[g])
            for g in (global_stage(c, pipeline_rank, pipeline_size) for c in range(chunks))]


@dataclass(frozen=True)
class PipelineSplit:
    """This rank's part of a stack of ``layers`` split into ``stages`` global stages of ``counts``
    layers each: the global stage and the global layer indices of each of its chunks. One process
    holds the whole stack as one chunk (:meth:`whole`)."""

    layers: int
    stages: int
    chunk_stages: tuple[int, ...]
    chunk_layers: tuple[range, ...]
    counts: tuple[int, ...]

    @classmethod
    def whole(cls, layers: int) -> PipelineSplit:
        return cls(layers, 1, (0,), (range(layers),), (layers,))

    @classmethod
    def for_rank(cls, layers: int, pipeline_size: int, pipeline_rank: int, chunks: int = 1,
                 counts: Sequence[int] | None = None) -> PipelineSplit:
        stages = pipeline_size * chunks
        counts = stage_layer_counts(layers, stages, counts)
        ranges = chunk_layer_ranges(counts, pipeline_size, pipeline_rank)
        return cls(layers, stages, tuple(global_stage(c, pipeline_rank, pipeline_size) for c in range(chunks)),
                   tuple(ranges), tuple(counts))

    @property
    def chunks(self) -> int:
        return len(self.chunk_stages)

    @property
    def holds_first_stage(self) -> bool:
        return self.chunk_stages[0] == 0

    @property
    def holds_last_stage(self) -> bool:
        return self.chunk_stages[-1] == self.stages - 1

    def is_first(self, chunk: int) -> bool:
        return self.chunk_stages[chunk] == 0

    def is_last(self, chunk: int) -> bool:
        return self.chunk_stages[chunk] == self.stages - 1

    def holds_layer(self, index: int) -> bool:
        return any(index in r for r in self.chunk_layers)


def sum_tied_grads(params: Iterable[torch.Tensor], embedding_group: Any) -> None:
    """The tied embedding's gradient on the first and last stage: the sum of both (the input
    embedding's and the output layer's), as one process computes it (Megatron-LM's embedding
    group)."""
    if group_size(embedding_group) < 2:
        return
    for p in params:
        if pipeline_tied_role(p) is not None and p.grad is not None:
            dist.all_reduce(p.grad, group=embedding_group)


class PipelineChannel:
    """Messages between the ranks of one pipeline: ``send`` is buffered (waited by
    :meth:`wait`), ``recv`` blocks. ``ranks``: the pipeline's global ranks in stage order. A
    message carries a tensor and one integer (``value``)."""

    def __init__(self, ranks: Sequence[int], group: Any, device: torch.device) -> None:
        self.ranks, self.group, self.device = list(ranks), group, device
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, pipeline_rank: int, value: int = 0) -> None:
        if tensor.dtype not in _DTYPES or not 1 <= tensor.dim() <= _HEADER - 3:
            raise TsConfigError(f"a pipeline stage sent a {tensor.dtype} tensor of {tensor.dim()} dimensions: only "
                                "floating point hidden states of 1 to 4 dimensions travel between stages")
        header = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape] + [0] * (_HEADER - 3 - tensor.dim())
        header.append(int(value))
        dst = self.ranks[pipeline_rank]
        for message in (torch.tensor(header, dtype=torch.long, device=self.device), tensor.detach().contiguous()):
            self._pending.append((dist.isend(message, dst, group=self.group), message))

    def recv(self, pipeline_rank: int) -> tuple[torch.Tensor, int]:
        src = self.ranks[pipeline_rank]
        header = torch.empty(_HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, src, group=self.group)
        code, ndim, *sizes, value = header.tolist()
        tensor = torch.empty(sizes[:ndim], dtype=_DTYPES[code], device=self.device)
        dist.recv(tensor, src, group=self.group)
        return tensor, value

    def wait(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def run_steps(steps: Sequence[Step], channel: PipelineChannel, pipeline_rank: int, chunks: int,
              forward: Callable[[int, int, torch.Tensor | None], torch.Tensor],
              backward_loss: Callable[[int, torch.Tensor], int] | None = None,
              stage_loss: Callable[[int, int, int], torch.Tensor | None] | None = None) -> None:
    """Run one rank's ``steps``. ``forward(chunk, microbatch, input)`` runs a chunk on the micro-batch
    (``input`` is ``None`` on global stage 0) and returns its output, on the last global stage the
    loss to differentiate; ``backward_loss(microbatch, loss)`` differentiates that loss (the
    optimizer's ``backward``, which applies fp16 loss scaling) and returns an integer that travels
    back with the gradients (the micro-batch's sample size); on the other stages
    ``stage_loss(chunk, microbatch, value)`` may give a scalar differentiated with the output (the
    MoE layers' auxiliary losses, which need that integer). Without ``backward_loss`` the steps are
    forward-only (validation): no gradient is kept."""
    p = len(channel.ranks)
    last = p * chunks - 1
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    for step in steps:
        key, g = (step.chunk, step.microbatch), global_stage(step.chunk, pipeline_rank, p)
        if step.kind == "F":
            x = channel.recv((g - 1) % p)[0] if g > 0 else None
            if x is not None and backward_loss is not None:
                x.requires_grad_()
            out = forward(step.chunk, step.microbatch, x)
            if g < last:
                channel.send(out, (g + 1) % p)
            if backward_loss is not None:
                inputs[key], outputs[key] = x, out
            continue
        x, out = inputs.pop(key), outputs.pop(key)
        if g == last:
            value = backward_loss(step.microbatch, out)
        else:
            grad, value = channel.recv((g + 1) % p)
            extra = stage_loss(step.chunk, step.microbatch, value) if stage_loss is not None else None
            if extra is None:
                torch.autograd.backward(out, grad)
            else:
                torch.autograd.backward([out, extra], [grad, torch.ones_like(extra)])
        if g > 0:
            channel.send(x.grad, (g - 1) % p, value)
    channel.wait()
