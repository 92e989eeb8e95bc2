"""Pipeline parallelism: the layer split into stages, the point-to-point messages between
stages, and the executor that runs one rank's schedule (:mod:`.pipeline_schedules`).

Why not ``torch.distributed.pipelining``: its ``PipelineStage`` infers one activation shape
and reuses it for every micro-batch, and its schedules cut one batch into equal
micro-batches and apply ``loss_fn(output, target)`` to each; fairseq's micro-batches are the
``--update-freq`` batches of different shapes, and its criterion needs the whole sample
(targets, token counts). Every stage of a pipeline reads the same batches (the data loader is
sharded over data-parallel ranks only), so a stage has the tokens, padding masks and positions
of every micro-batch itself, and knows the shape of every message before it arrives; only
hidden states and their gradients travel, with no header and no host read. The executor is as
small as Megatron-core's ``schedules.py`` with its ``p2p_communication.py``: it issues
:func:`~.pipeline_schedules.executor_program`, each step's sends and receives posted as one
``batch_isend_irecv`` and waited, which :func:`~.pipeline_schedules.simulate` checks to be free of
deadlocks under NCCL's semantics and in channel order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import pipeline_tied_role
from torchscale_fairseq.model_parallel.pipeline_schedules import (
    Message,
    Post,
    Step,
    Transfer,
    executor_program,
    global_stage,
)
from torchscale_fairseq.model_parallel.process_groups import group_size


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
    """Messages between the ranks of one pipeline (``ranks``: their global ranks in stage order),
    each of the shape ``shape(microbatch)`` and of ``dtype``, known on both sides in advance."""

    def __init__(self, ranks: Sequence[int], group: Any, device: torch.device, dtype: torch.dtype,
                 shape: Callable[[int], Sequence[int]]) -> None:
        self.ranks, self.group, self.device, self.dtype, self.shape = list(ranks), group, device, dtype, shape

    def exchange(self, post: Post, outgoing: dict[Transfer, torch.Tensor]) -> dict[Transfer, torch.Tensor]:
        """Issue ``post``'s transfers as one batch (``outgoing``: the tensor of each send) and wait
        for all of them; the received tensors, by transfer."""
        ops, received = [], {}
        for t in post.transfers:
            expected = tuple(self.shape(t.message.microbatch))
            if t.send:
                tensor = outgoing[t]
                if tuple(tensor.shape) != expected or tensor.dtype != self.dtype:
                    what = "hidden states" if t.message.kind == "F" else "gradient"
                    raise TsConfigError(
                        f"pipeline stage {t.message.stage} sends micro-batch {t.message.microbatch}'s {what} as "
                        f"{tensor.dtype} {tuple(tensor.shape)} where the receiving stage expects {self.dtype} {expected} "
                        "(the stage's output must be the (batch, sequence, embed_dim) hidden states in the run's precision)")
                ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), self.ranks[t.peer], self.group))
            else:
                received[t] = torch.empty(expected, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, received[t], self.ranks[t.peer], self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received


def run_steps(steps: Sequence[Step], channel: PipelineChannel, pipeline_rank: int, chunks: int,
              forward: Callable[[int, int, torch.Tensor | None], torch.Tensor],
              backward: Callable[[int, torch.Tensor], None] | None = None) -> None:
    """Run one rank's ``steps`` as :func:`~.pipeline_schedules.executor_program` issues them.
    ``forward(chunk, microbatch, input)`` runs a chunk on the micro-batch (``input`` is ``None`` on
    global stage 0) and returns its output, on the last global stage the loss to differentiate,
    which ``backward(microbatch, loss)`` does (the optimizer's ``backward``, which applies fp16 loss
    scaling); the other stages differentiate their output with the gradient received. Without
    ``backward`` the steps are forward-only (validation): no gradient is kept."""
    p = len(channel.ranks)
    last = p * chunks - 1
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    outgoing: dict[Transfer, torch.Tensor] = {}
    received: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, chunk, micro-batch) -> the step's input
    for item in executor_program(steps, pipeline_rank, p, chunks):
        if isinstance(item, Post):
            for t, tensor in channel.exchange(item, outgoing).items():
                g = t.message.stage + (1 if t.message.kind == "F" else -1)
                received[t.message.kind, g // p, t.message.microbatch] = tensor
            outgoing = {t: outgoing[t] for t in outgoing if t not in item.transfers}
            continue
        step = item
        key, g = (step.chunk, step.microbatch), global_stage(step.chunk, pipeline_rank, p)
        if step.kind == "F":
            x = received.pop(("F", *key)) if g > 0 else None
            if x is not None and backward is not None:
                x.requires_grad_()
            out = forward(step.chunk, step.microbatch, x)
            if g < last:
                outgoing[Transfer(True, (g + 1) % p, Message("F", g, step.microbatch))] = out
            if backward is not None:
                inputs[key], outputs[key] = x, out
            continue
        x, out = inputs.pop(key), outputs.pop(key)
        if g == last:
            backward(step.microbatch, out)
        else:
            torch.autograd.backward(out, received.pop(("B", *key)))
        if g > 0:
            outgoing[Transfer(True, (g - 1) % p, Message("B", g, step.microbatch))] = x.grad
