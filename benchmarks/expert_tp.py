"""Split vs replicated experts under tensor parallelism: forward+backward time of one MoE
layer (top-2, second expert always kept, capacity factor 1.25, Magneto Sub-LN) on 2 gloo
ranks of one tensor-parallel group, ``--moe-expert-tensor-parallel split`` (each rank 1/2
of every expert, one all-reduce of the expert output rows forward, one of the token
gradients backward, and the Sub-LN statistics) against ``replicate`` (whole experts on
both ranks, no collective in the layer), with the expert parameters per rank.

Method: per size, the two layers are timed alternately (order reversed every other
round) so both see the same machine; reported: best and median of ``--repeats`` rounds
after one warm-up, rank 0's clock, each step ending with a barrier. Every rank runs with
``--threads`` threads.

Usage: ``.venv/bin/python benchmarks/expert_tp.py [--repeats 7] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import rendezvous_url  # noqa: E402
from torchscale_fairseq.model_parallel.attributes import is_expert  # noqa: E402
from torchscale_fairseq.model_parallel.parallel_context import build_parallel_context  # noqa: E402
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig  # noqa: E402
from torchscale_fairseq.modules.moe.layer import MoELayer  # noqa: E402

# (tokens, d, ffn, experts)
SIZES = [(1024, 64, 256, 8), (1024, 128, 512, 8), (2048, 256, 1024, 8), (2048, 512, 2048, 8), (4096, 512, 2048, 16)]


def step(layer: MoELayer, x: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    layer.zero_grad(set_to_none=True)
    y, aux = layer(x)
    (y.sum() + aux.balance_loss).backward()
    dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, args: argparse.Namespace, init_method: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    tp = build_parallel_context(2).tensor_group
    for tokens, d, f, e in SIZES:
        cfg = MoEConfig(expert_count=e, second_expert_policy="all")
        layers = {}
        for mode, group in (("split", tp), ("replicate", None)):
            torch.manual_seed(1)
            layers[mode] = MoELayer(cfg, FFNSpec(d, f, subln=True), tp_group=group)
        x = torch.randn(tokens, 1, d, generator=torch.Generator().manual_seed(2)).requires_grad_()
        times: dict[str, list[float]] = {m: [] for m in layers}
        for m in layers:
            step(layers[m], x)  # warm-up
        for r in range(args.repeats):
            for m in (list(layers) if r % 2 == 0 else list(layers)[::-1]):
                times[m].append(step(layers[m], x))
        if rank == 0:
            params = {m: sum(p.numel() for p in layer.parameters() if is_expert(p)) for m, layer in layers.items()}
            best = {m: min(t) for m, t in times.items()}
            med = {m: statistics.median(t) for m, t in times.items()}
            print(f"T={tokens} d={d} ffn={f} E={e}: split best {best['split'] * 1e3:.1f} ms median "
                  f"{med['split'] * 1e3:.1f} | replicate best {best['replicate'] * 1e3:.1f} ms median "
                  f"{med['replicate'] * 1e3:.1f} | split/replicate best {best['split'] / best['replicate']:.2f} "
                  f"median {med['split'] / med['replicate']:.2f} | expert params/rank {params['split']} vs "
                  f"{params['replicate']}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, rendezvous_url(tmp)), nprocs=2)


if __name__ == "__main__":
    main()
