"""The pipeline executor (``run_steps`` over ``PipelineChannel``) on gloo ranks, against one process:
a stack of ``tanh(Linear(x))`` stages split over P = 2 and 3 ranks, micro-batches of different
shapes (each side knows every message's shape from the micro-batch, no header travels), under
GPipe, 1F1B and interleaved 1F1B: every stage's gradients and the losses equal one process
running the micro-batches in order; forward-only steps give the same outputs. A message of
another shape than the receiver expects is a one-line error on the sending side, before any
message is posted."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.rendezvous import rendezvous_url, start_ranks
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.pipeline_parallel import PipelineChannel, run_steps
from torchscale_fairseq.model_parallel.pipeline_schedules import (
    Message,
    Post,
    Transfer,
    forward_only_steps,
    global_stage,
    schedule_steps,
)

WIDTH = 8
SHAPES = [(2, 3), (1, 5), (3, 2), (2, 4), (1, 1), (2, 2)]  # (batch, length) of each micro-batch


def _stack(stages: int) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(stages)]


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(b, t, WIDTH, generator=g, dtype=torch.float64) for b, t in SHAPES]


def _check(rank: int, world: int, group, schedule: str, chunks: int) -> None:
    stages = world * chunks
    layers, inputs = _stack(stages), _inputs()
    m = len(inputs) if chunks == 1 or schedule == "gpipe" else world * (len(inputs) // world)
    losses = []
    for x in inputs[:m]:  # one process: every micro-batch through every stage, in order
        for layer in layers:
            x = torch.tanh(layer(x))
        loss = x.pow(2).sum()
        loss.backward()
        losses.append(float(loss))
    reference = [[p.grad.clone() for p in layer.parameters()] for layer in layers]
    for layer in layers:
        layer.zero_grad()
    seen: dict[int, float] = {}

    def forward(chunk: int, i: int, hidden: torch.Tensor | None) -> torch.Tensor:
        g = global_stage(chunk, rank, world)
        out = torch.tanh(layers[g](inputs[i] if hidden is None else hidden))
        if g == stages - 1:
            seen[i] = float(out.pow(2).sum())
            return out.pow(2).sum()
        return out

    channel = PipelineChannel(list(range(world)), group, torch.device("cpu"), torch.float64,
                              lambda i: (*SHAPES[i], WIDTH))
    steps = schedule_steps(schedule, world, rank, m, chunks)
    run_steps(steps, channel, rank, chunks, forward, lambda i, loss: loss.backward())
    for chunk in range(chunks):
        g = global_stage(chunk, rank, world)
        for ours, want in zip(layers[g].parameters(), reference[g]):
            assert torch.allclose(ours.grad, want, rtol=1e-12, atol=1e-12), (schedule, chunks, rank, g)
    last = rank == (stages - 1) % world
    if last:
        assert [seen[i] for i in range(m)] == pytest.approx(losses, rel=1e-12), (schedule, chunks)
    seen.clear()
    with torch.no_grad():
        run_steps(forward_only_steps(world, m, chunks), channel, rank, chunks, forward)
    if last:
        assert [seen[i] for i in range(m)] == pytest.approx(losses, rel=1e-12), (schedule, chunks, "forward only")


def _worker(rank: int, world: int, init: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("gpipe", 2)):
        _check(rank, world, group, schedule, chunks)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_executor_equals_one_process(tmp_path, world):
    start_ranks(_worker, (world, rendezvous_url(tmp_path)), world)


def test_a_message_of_another_shape_is_one_line_on_the_sender():
    channel = PipelineChannel([0, 1], None, torch.device("cpu"), torch.float32, lambda i: (2, 3, WIDTH))
    send = Transfer(True, 1, Message("F", 0, 4))
    with pytest.raises(TsConfigError, match=r"^pipeline stage 0 sends micro-batch 4's hidden states as torch.float32 "
                                            r"\(2, 4, 8\) where the receiving stage expects torch.float32 \(2, 3, 8\)"):
        channel.exchange(Post((send,)), {send: torch.zeros(2, 4, WIDTH)})
    with pytest.raises(TsConfigError, match="as torch.float16 .* expects torch.float32"):
        channel.exchange(Post((send,)), {send: torch.zeros(2, 3, WIDTH, dtype=torch.float16)})
