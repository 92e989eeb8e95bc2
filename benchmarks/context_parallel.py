"""Context parallelism on CPU/gloo: activation memory per rank against ``C`` and the ring's bytes
against its formula (``model_parallel/context_parallel.py``).

For each ``C`` the ranks run a stack of ``L`` Pre-LN layers on their chunks ``r`` and ``2C-1-r``
of one ``b x s`` sequence (hidden ``h``, fp32), forward and backward; per rank it reports the
bytes autograd keeps for backward (the distinct storages of the saved tensors, counted with
``torch.autograd.graph.saved_tensors_hooks``) and the bytes the ring sends (``batch_isend_irecv``,
counted with ``benchmarks/collective_recorder.py``) against ``L (C-1) 2 b (s/C) h 4`` forward and
``L ((C-1) 2 + 2 C) b (s/C) h 4`` backward.

    .venv/bin/python benchmarks/context_parallel.py [--sizes 1 2 4 --seq 2048 --hidden 256 --heads 4 --layers 2]

Prints a markdown table (for RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.collective_recorder import record_collectives
    from torchscale_fairseq.architecture.config import StackConfig
    from torchscale_fairseq.architecture.layer import TransformerLayer
    from torchscale_fairseq.model_parallel.context_parallel import context_parallel_indices
    from torchscale_fairseq.model_parallel.parallel_context import build_parallel_context
    from torchscale_fairseq.modules.backbone import build_backbone

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank, world_size=args.size)
    parallel = build_parallel_context(1, 1, None, args.size)
    b, s, h = 1, args.seq, args.hidden
    cfg = StackConfig(embed_dim=h, ffn_dim=4 * h, layers=args.layers, attention_heads=args.heads,
                      backbone=build_backbone("preln", "decoder_only", 0, args.layers), max_positions=s, dropout=0.0,
                      parallel=parallel)
    torch.manual_seed(0)
    layers = [TransformerLayer(cfg) for _ in range(args.layers)]
    x = torch.randn(b, s, h)[:, context_parallel_indices(s, args.size, args.rank)].requires_grad_()
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with record_collectives(point_to_point=True) as log:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            y = x
            for layer in layers:
                y = layer(y, causal=True)[0]
        y.sum().backward()
    sent = {d: 4 * sum(n for kind, direction, n in log if kind == "send" and direction == d)
            for d in ("forward", "backward")}
    if args.rank == 0:
        Path(args.out).write_text(json.dumps({"saved": sum(storages.values()), "sent": sent}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    for name, default in (("seq", 2048), ("hidden", 256), ("heads", 4), ("layers", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--size", type=int)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--init-method")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rank is not None:
        worker(args)
        return
    from benchmarks._common import rendezvous_url

    s, h, layers = args.seq, args.hidden, args.layers
    lines = [f"b=1, s={s}, h={h}, heads={args.heads}, {layers} Pre-LN layers, fp32, rank 0",
             "", "| C | activations kept (MB) | x C=1 | ring sent forward (B) | formula | ring sent backward (B) | formula |",
             "|---|---|---|---|---|---|---|"]
    first = None
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rank0.json"
            base = [sys.executable, __file__, "--seq", str(s), "--hidden", str(h), "--heads", str(args.heads),
                    "--layers", str(layers), "--size", str(size), "--init-method", rendezvous_url(tmp), "--out", str(out)]
            procs = [subprocess.Popen([*base, "--rank", str(r)]) for r in range(size)]
            if any(p.wait() != 0 for p in procs):
                raise SystemExit("a rank failed")
            row = json.loads(out.read_text())
        first = first or row["saved"]
        block = (s // size) * h * 4
        forward, backward = layers * (size - 1) * 2 * block, layers * ((size - 1) * 2 + 2 * size) * block
        if size == 1:
            backward = 0
        lines.append(f"| {size} | {row['saved'] / 2**20:.2f} | {row['saved'] / first:.3f} | {row['sent']['forward']:,} | "
                     f"{forward:,} | {row['sent']['backward']:,} | {backward:,} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
