"""Tensor-parallel communication per transformer layer, measured against Megatron-LM's
count (section 3): 2 all-reduces of ``b x s x h`` forward and 2 backward per layer, plus
for Magneto 4 + 4 all-reduces of ``b x s`` LayerNorm statistics; the vocabulary-parallel
loss exchanges ``b x s`` + ``3 b x s`` numbers. Sizes are payload bytes of the reduced
tensors (fp32); a ring all-reduce moves ``2 (N - 1) / N`` times that per rank.

    .venv/bin/python benchmarks/tp_bytes.py [--batch 4 --seq 128 --hidden 512 --ffn 2048 --heads 8]

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
    from torchscale_fairseq.model_parallel.cross_entropy import vocab_parallel_cross_entropy
    from torchscale_fairseq.model_parallel.parallel_context import build_parallel_context
    from torchscale_fairseq.modules.backbone import build_backbone

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank, world_size=2)
    parallel = build_parallel_context(2)
    b, s, h = args.batch, args.seq, args.hidden
    rows = {}
    for backbone in ("magneto", "preln"):
        cfg = StackConfig(embed_dim=h, ffn_dim=args.ffn, layers=12, attention_heads=args.heads,
                          backbone=build_backbone(backbone, "decoder_only", 0, 12), max_positions=s, dropout=0.0,
                          parallel=parallel)
        torch.manual_seed(0)
        layer = TransformerLayer(cfg)
        x = torch.randn(b, s, h, requires_grad=True)
        with record_collectives() as log:
            layer(x, causal=True)[0].sum().backward()
        rows[backbone] = log
    logits = torch.randn(b * s, 512, requires_grad=True)
    with record_collectives() as log:
        vocab_parallel_cross_entropy(logits, torch.randint(0, 1000, (b * s,)), 1000,
                                     parallel.tensor_group).nll.sum().backward()
    rows["loss"] = log
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def table(rows: dict, b: int, s: int, h: int) -> str:
    def total(log, numel, direction):
        return [n for op, d, n in log if op == "all_reduce" and n == numel and d == direction]

    lines = [
        f"b={b}, s={s}, h={h}, N=2, fp32 payload bytes per rank",
        "",
        "| what | direction | measured collectives | measured bytes | formula | formula bytes |",
        "|---|---|---|---|---|---|",
    ]
    for backbone in ("preln", "magneto"):
        log = rows[backbone]
        for direction, formula, count in (("forward", "2 x bsh", 2), ("backward", "2 x bsh", 2)):
            sizes = total(log, b * s * h, direction)
            lines.append(f"| {backbone} layer, large | {direction} | {len(sizes)} | {4 * sum(sizes):,} | "
                         f"{formula} | {4 * count * b * s * h:,} |")
        stats = 4 if backbone == "magneto" else 0
        for direction in ("forward", "backward"):
            sizes = total(log, b * s, direction)
            lines.append(f"| {backbone} layer, LN statistics | {direction} | {len(sizes)} | {4 * sum(sizes):,} | "
                         f"{stats} x bs | {4 * stats * b * s:,} |")
    sizes = [n for _, _, n in rows["loss"]]
    lines.append(f"| vocab-parallel loss | forward | {len(sizes)} | {4 * sum(sizes):,} | bs + 3 bs | {16 * b * s:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in (("batch", 4), ("seq", 128), ("hidden", 512), ("ffn", 2048), ("heads", 8)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--init-method")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rank is not None:
        worker(args)
        return
    from benchmarks._common import rendezvous_url

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        base = [sys.executable, __file__, *sum(([f"--{k}", str(getattr(args, k))] for k in
                                                ("batch", "seq", "hidden", "ffn", "heads")), [])]
        init_method = rendezvous_url(tmp)
        procs = [subprocess.Popen([*base, "--rank", str(r), "--init-method", init_method, "--out", str(out)])
                 for r in range(2)]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("a rank failed")
        print(table(json.loads(out.read_text()), args.batch, args.seq, args.hidden))


if __name__ == "__main__":
    main()
