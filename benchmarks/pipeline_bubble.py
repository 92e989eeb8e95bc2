"""Pipeline bubble and activation memory per stage, measured on gloo ranks with the plugin's
executor and schedules (:mod:`torchscale_fairseq.model_parallel.pipeline_parallel`), next to
the formulas; then the schedule simulator with the layer costs measured here for clusters of
8 and 16 stages.

Each rank runs one stage of ``--layers-per-stage`` Magneto transformer layers (d = 256, 4 heads,
FFN 1024, 128 tokens x 8 sequences per micro-batch, fp32, one thread), the last stage a squared
mean as the loss. Per update (after one warm-up update), per stage:

- idle fraction of the update = 1 - busy / makespan (the slowest stage's wall: the update ends
  when its last backward does; a stage's own wall ends earlier on the later stages), busy the
  stage's compute time. ``--compute real`` runs the
  layers (busy = the main thread's CPU time: gloo's blocking receives use none), which needs a
  core per rank (P = 2 here); ``--compute sleep`` replaces each forward and backward by a sleep of
  the real layer's measured time (busy = the sleeps), so that P = 4 ranks on 2 cores measure the
  schedule and its messages, not the cores' time-sharing.
  Formula: the idle share of the wall, ``(P - 1) / (m + P - 1)`` for GPipe and 1F1B,
  ``(P - 1) / (V m + P - 1)`` interleaved (Narayanan et al. 2021, section 2.2: bubble
  ``(P - 1) / m`` and ``(P - 1) / (V m)`` of the ideal time);
- micro-batches held (``--compute real``) = the peak bytes of the tensors the stage saved for backward (a
  ``saved_tensors_hooks`` pack hook; parameters excluded), in units of one micro-batch's saved
  bytes: 1F1B holds at most ``P - s`` on stage ``s``, GPipe ``m``.

    .venv/bin/python benchmarks/pipeline_bubble.py [--stages 2 4] [--microbatches 4 8 16] [--compute real|sleep]

Prints markdown tables (for RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchscale_fairseq.architecture.config import StackConfig  # noqa: E402
from torchscale_fairseq.architecture.layer import TransformerLayer  # noqa: E402
from torchscale_fairseq.model_parallel.parallel_context import build_parallel_context  # noqa: E402
from torchscale_fairseq.model_parallel.pipeline_parallel import PipelineChannel, run_steps  # noqa: E402
from torchscale_fairseq.model_parallel.pipeline_schedules import schedule_steps, simulate  # noqa: E402
from torchscale_fairseq.modules.backbone import build_backbone  # noqa: E402

DIM, HEADS, FFN, SEQ, BATCH = 256, 4, 1024, 128, 8
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("1f1b", 2))  # (schedule, virtual stages): 1F1B with V = 2 is interleaved


def build_layers(count: int) -> nn.Module:
    cfg = StackConfig(embed_dim=DIM, ffn_dim=FFN, layers=count, attention_heads=HEADS,
                      backbone=build_backbone("magneto", "decoder_only", 0, count), max_positions=SEQ, dropout=0.0)
    layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(count))

    class Chunk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x, causal=True)[0]
            return x

    return Chunk()


class Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x * 1.0

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SavedBytes:
    """Live bytes of the tensors autograd saved (parameters excluded) and their peak."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.live, self.peak = params, 0, 0

    def pack(self, t: torch.Tensor):
        if t.data_ptr() in self.params:
            return t
        return _Held(self, t)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


class _Held:
    def __init__(self, owner: SavedBytes, tensor: torch.Tensor) -> None:
        self.owner, self.tensor, self.nbytes = owner, tensor, tensor.numel() * tensor.element_size()
        owner.live += self.nbytes
        owner.peak = max(owner.peak, owner.live)

    def __del__(self) -> None:
        self.owner.live -= self.nbytes


def layer_costs(layers_per_stage: int, repeats: int = 5) -> tuple[float, float, int]:
    """Forward and backward seconds of one stage on one micro-batch, and its saved bytes."""
    torch.manual_seed(0)
    chunk = build_layers(layers_per_stage)
    x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
    saved = SavedBytes({p.data_ptr() for p in chunk.parameters()})
    fwd, bwd = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = chunk(x)
        t1 = time.perf_counter()
        out.pow(2).mean().backward()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return sorted(fwd[1:])[repeats // 2], sorted(bwd[1:])[repeats // 2], saved.peak


def stage_forward(stage: list[nn.Module], inputs: list[torch.Tensor], rank: int, world: int, chunks: int,
                  sleeps: tuple[float, float] | None):
    """The executor's ``forward``: this rank's chunk on a micro-batch (or a sleep of its measured
    time), the last global stage's squared mean as the loss."""
    last = world * chunks - 1

    def forward(chunk: int, i: int, hidden: torch.Tensor | None) -> torch.Tensor:
        x = inputs[i] if hidden is None else hidden
        x = Sleep.apply(x, sleeps[0] / chunks, sleeps[1] / chunks) if sleeps else stage[chunk](x)
        return x.pow(2).mean() if chunk * world + rank == last else x

    return forward


def rank_main(rank: int, world: int, init: str, args: argparse.Namespace, costs: tuple[float, float, int],
              queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    context = build_parallel_context(1, world)
    channel = PipelineChannel(context.pipeline_ranks, context.pipeline_group, torch.device("cpu"), torch.float32,
                              lambda i: (BATCH, SEQ, DIM))
    forward_s, backward_s, per_microbatch = costs
    for schedule, chunks in SCHEDULES:
        torch.manual_seed(rank)
        stage = [build_layers(max(1, args.layers_per_stage // chunks)) for _ in range(chunks)]
        params = {p.data_ptr() for chunk in stage for p in chunk.parameters()}
        for m in args.microbatches:
            if chunks > 1 and m % world != 0:
                continue
            inputs = [torch.randn(BATCH, SEQ, DIM, requires_grad=args.compute == "sleep") for _ in range(m)]
            forward = stage_forward(stage, inputs, rank, world, chunks,
                                    (forward_s, backward_s) if args.compute == "sleep" else None)
            steps = schedule_steps(schedule, world, rank, m, chunks)
            walls, busies, peaks = [], [], []
            for update in range(args.updates + 1):
                saved = SavedBytes(params)
                dist.barrier()
                cpu0, wall0 = time.thread_time(), time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    run_steps(steps, channel, rank, chunks, forward, lambda i, loss: loss.backward())
                wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
                if update > 0:
                    walls.append(wall)
                    busies.append(m * (forward_s + backward_s) if args.compute == "sleep" else cpu)
                    peaks.append(saved.peak)
            idle, busy = 1 - sum(busies) / sum(walls), sum(busies) / len(busies)
            label = f"interleaved (V={chunks})" if chunks > 1 else schedule
            held = max(peaks) / per_microbatch if args.compute == "real" else float("nan")
            queue.put((label, world, m, rank, idle, held, sum(walls) / len(walls), busy))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--compute", choices=("real", "sleep"), default="real")
    args = parser.parse_args()
    torch.set_num_threads(1)
    forward_s, backward_s, saved = layer_costs(args.layers_per_stage)
    print(f"one stage ({args.layers_per_stage} layers, d={DIM}, {BATCH}x{SEQ} tokens): forward {forward_s * 1e3:.1f} ms, "
          f"backward {backward_s * 1e3:.1f} ms, saved {saved / 2**20:.1f} MiB per micro-batch; compute: {args.compute}\n")
    rows = []
    for world in args.stages:
        queue = mp.get_context("spawn").SimpleQueue()
        with tempfile.TemporaryDirectory() as tmp:
            init = Path(tmp, "rendezvous").as_uri()
            mp.start_processes(rank_main, args=(world, init, args, (forward_s, backward_s, saved), queue),
                               nprocs=world, start_method="spawn")  # (the parent ran autograd: no fork)
        while not queue.empty():
            rows.append(queue.get())
    print("| schedule | P | m | idle of the update (measured) | formula | stage idle, own wall (0..P-1) | "
          "micro-batches held (0..P-1) | limit | update (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, int, int], list] = {}
    for label, world, m, rank, idle, held, wall, busy in rows:
        groups.setdefault((label, world, m), []).append((rank, idle, held, wall, busy))
    for (label, world, m), stages in sorted(groups.items()):
        stages.sort()
        chunks = 2 if label.startswith("interleaved") else 1
        makespan = max(wall for _, _, _, wall, _ in stages)
        update_idle = 1 - sum(busy for *_, busy in stages) / (len(stages) * makespan)
        formula = (world - 1) / (chunks * m + world - 1)
        limit = {"gpipe": f"{m}", "1f1b": "/".join(str(min(world - s, m)) for s in range(world))}.get(label, "-")
        own = "/".join(f"{idle:.3f}" for _, idle, _, _, _ in stages)
        held = "/".join("-" if held != held else f"{held:.2f}" for _, _, held, _, _ in stages)
        print(f"| {label} | {world} | {m} | {update_idle:.3f} | {formula:.3f} | {own} | {held} | {limit} | "
              f"{makespan:.3f} |")
    print("\nSimulated with these costs (a stage = the layers above; bubble as a share of the update):\n")
    print("| P | m | GPipe / 1F1B | interleaved V=2 | interleaved V=4 |")
    print("|---|---|---|---|---|")
    for world in (8, 16):
        for m in (8, 16, 32, 64):
            cells = []
            for schedule, chunks in (("1f1b", 1), ("1f1b", 2), ("1f1b", 4)):
                if chunks > 1 and m % world != 0:
                    cells.append("-")
                    continue
                steps = [schedule_steps(schedule, world, s, m, chunks) for s in range(world)]
                sim = simulate(steps, chunks, forward_s / chunks, backward_s / chunks)
                cells.append(f"{sum(sim.bubble) / world:.3f}")
            print(f"| {world} | {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
