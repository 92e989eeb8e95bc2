"""How much of an X-MoE layer's time at many experts is reading expert weights from memory.

Times, on one core: a 1 GB read (``sum``), write (``fill_``) and copy; then the fc1
forward GEMM of ``moe_layer.py`` at E experts of C = 2T/E rows, with E distinct weights
(read from memory) and with one weight for all E (stays in cache), as one ``bmm`` and
as a loop of ``mm``, next to the dense GEMM on the same 2T rows. The distinct-minus-cached difference is the weight
traffic; see "Why E = 256 stays above target" in ``RESULTS.md``.

Usage: ``.venv/bin/python benchmarks/moe_weight_traffic.py [--experts 256] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import load_average, now
from benchmarks.moe_layer import best_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    e, d, f = args.experts, args.dim, args.ffn
    rows = 2 * args.tokens
    c = rows // e
    weights = torch.randn(e, d, f) * 0.02
    other = torch.empty_like(weights)
    gb = weights.nbytes / 2**30
    x = torch.randn(e, c, d)
    cached = weights[:1].expand(e, d, f)
    x_dense, w_dense = x.reshape(rows, d), weights[0]
    print(f"# {now()} | load {load_average()} | 1 thread | E={e} C={c} d={d} ffn={f} | best of {args.repeats}")
    print("| op | ms |\n|---|---|")
    for name, fn in [
        (f"read {gb:.2f} GB (sum)", lambda: weights.sum()),
        (f"write {gb:.2f} GB (fill_)", lambda: other.fill_(1.0)),
        (f"copy {gb:.2f} GB", lambda: other.copy_(weights)),
        (f"bmm, {e} distinct weights", lambda: torch.bmm(x, weights)),
        (f"bmm, one weight broadcast to {e}", lambda: torch.bmm(x, cached)),
        (f"{e} x mm, distinct weights", lambda: [torch.mm(x[i], weights[i]) for i in range(e)]),
        (f"{e} x mm, one weight", lambda: [torch.mm(x[i], w_dense) for i in range(e)]),
        (f"dense mm, {rows} rows", lambda: torch.mm(x_dense, w_dense)),
    ]:
        print(f"| {name} | {best_times([fn], args.repeats)[0] * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
