"""Forward+backward time of one MoE layer (top-2, T = 8192 tokens, d = 512, FFN 2048)
for E = 16, 64, 256, divided by 2x the time of a dense FFN of the same size on the same
tokens (ideal ratio 1.0: top-2 does two FFNs' work per token). A GShard-style one-hot
dispatch (``T x E x C`` einsums) with the same router and experts is timed in the same
run as the reference. Capacity factor 1.0, second expert always kept (worst case).

Usage: ``.venv/bin/python benchmarks/moe_layer.py [--tokens 8192] [--repeats 3] [--threads 1]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import load_average, now
from torchscale_fairseq.modules.feedforward import FeedForwardNetwork
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.layer import MoELayer


def best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def fwd_bwd(module, x: torch.Tensor):
    def step():
        module.zero_grad(set_to_none=True)
        module(x).sum().backward()
    return step


def one_hot_step(layer: MoELayer, x: torch.Tensor):
    """GShard dispatch: combine (T, E, C), dispatch = combine > 0, two einsums."""
    def step():
        layer.zero_grad(set_to_none=True)
        tokens = x.reshape(-1, x.size(-1))
        _, r = layer.route(tokens)
        cap = int(r.slot.max()) + 1
        combine = torch.zeros(tokens.size(0), layer.cfg.expert_count, cap)
        combine = combine.index_put((r.token, r.expert, r.slot), r.gate)
        dispatch = (combine > 0).to(tokens.dtype)
        expert_in = torch.einsum("tec,td->ecd", dispatch, tokens)
        out = torch.einsum("tec,ecd->td", combine, layer.experts(expert_in))
        out.sum().backward()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-one-hot-above", type=int, default=256, help="skip the einsum reference above this E")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.tokens // 512, 512, args.dim, requires_grad=True) if args.tokens % 512 == 0 else \
        torch.randn(1, args.tokens, args.dim, requires_grad=True)
    dense = FeedForwardNetwork(args.dim, args.ffn)
    t_dense = best_time(fwd_bwd(dense, x), args.repeats)
    print(f"# {now()} | load {load_average()} | threads {args.threads} | T={args.tokens} d={args.dim} "
          f"ffn={args.ffn} top-2 cf=1.0 | dense FFN fwd+bwd {t_dense * 1e3:.0f} ms")
    print("| E | MoE fwd+bwd (ms) | ratio to 2x dense | one-hot einsum (ms) | one-hot ratio |")
    print("|---|---|---|---|---|")
    ratios = {}
    for e in args.experts:
        cfg = MoEConfig(expert_count=e, top_k=2, capacity_factor=1.0, second_expert_policy="all")
        layer = MoELayer(cfg, args.dim, args.ffn)
        t_moe = best_time(fwd_bwd(layer, x), args.repeats)
        ratios[e] = t_moe / (2 * t_dense)
        if e <= args.skip_one_hot_above:
            t_ref = best_time(one_hot_step(layer, x), max(1, args.repeats - 1))
            ref = f"{t_ref * 1e3:.0f} | {t_ref / (2 * t_dense):.2f}"
        else:
            ref = "skipped | -"
        print(f"| {e} | {t_moe * 1e3:.0f} | {ratios[e]:.2f} | {ref} |", flush=True)
    first, last = args.experts[0], args.experts[-1]
    print(f"growth E={first} -> E={last}: {100 * (ratios[last] / ratios[first] - 1):+.1f}%")


if __name__ == "__main__":
    main()
