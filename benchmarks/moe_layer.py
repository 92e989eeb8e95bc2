"""Forward+backward time of one MoE layer (top-2, T = 8192 tokens, d = 512, FFN 2048)
for E = 16, 64, 256, divided by 2x the time of a dense FFN of the same size on the same
tokens (ideal ratio 1.0: top-2 does two FFNs' work per token). A GShard-style one-hot
dispatch (``T x E x C`` einsums) with the same router and experts is timed in the same
run as the reference. Capacity factor 1.0, second expert always kept (worst case).

Method: every step is ``zero_grad(set_to_none=True)`` then forward, ``sum()`` and
backward, for the dense FFN, the MoE layer and the reference alike (``set_to_none``
is what fairseq's optimizers do every update, so gradients are new tensors each step
unless a module reuses memory, as the experts do, see
:mod:`torchscale_fairseq.modules.moe.experts`). The runs of the dense FFN and of the MoE
layer at every E are interleaved in one loop (order reversed every other round), so that
all of them see the same machine: on the shared 2-core VM, speed drifts by 10-15% over
minutes and single steps vary by +-10%, and timing one E after another made the drift
look like growth with E (or hid it). Reported: the best and the median of ``--repeats``
runs after one warm-up; the one-hot reference is the best of up to 3.

Usage: ``.venv/bin/python benchmarks/moe_layer.py [--tokens 8192] [--repeats 12] [--threads 1]``;
on a GPU ``--device cuda --dtype bf16`` (each timed run ends with ``torch.cuda.synchronize``). The
last line, ``RESULT``, gives the median ratio at every E and the verdict against ``--target``
(1.25) at the worst E.
``--expert-gemm``: ``auto`` (the layer's default: ``torch._grouped_mm`` on a Hopper GPU in bf16
once its probe passed, one ``addmm`` per expert elsewhere), ``grouped`` or ``loop`` (forced; the CPU
runs ``torch._grouped_mm`` too, as a loop of GEMMs inside PyTorch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import DTYPES, device_line, load_average, now
from torchscale_fairseq.modules.feedforward import FeedForwardNetwork, FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.layer import MoELayer


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def interleaved_times(fns: list, repeats: int) -> list[list[float]]:
    """``repeats`` timed runs of each of ``fns`` after one warm-up run each, interleaved, in
    reverse order every other round (so no function always runs after the same one); GPU
    work is waited for before and after each run."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for round_ in range(repeats):
        order = range(len(fns)) if round_ % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            _synchronize()
            start = time.perf_counter()
            fns[i]()
            _synchronize()
            times[i].append(time.perf_counter() - start)
    return times


def best_times(fns: list, repeats: int) -> list[float]:
    """Best of ``repeats`` interleaved runs of each of ``fns``."""
    return [min(t) for t in interleaved_times(fns, repeats)]


def fwd_bwd(module, x: torch.Tensor):
    """One forward and backward of a dense FFN or an MoE layer (whose output comes with its aux)."""
    def step():
        module.zero_grad(set_to_none=True)
        out = module(x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    return step


def one_hot_step(layer: MoELayer, x: torch.Tensor):
    """GShard dispatch: combine (T, E, C), dispatch = combine > 0, two einsums."""
    def step():
        layer.zero_grad(set_to_none=True)
        tokens = x.reshape(-1, x.size(-1))
        _, r = layer.route(layer.router(tokens))
        cap = int(r.slot.max()) + 1
        combine = torch.zeros(tokens.size(0), layer.cfg.expert_count, cap, device=tokens.device, dtype=tokens.dtype)
        combine = combine.index_put((r.token, r.expert, r.slot), r.gate.to(combine.dtype))  # gates are fp32
        dispatch = (combine > 0).to(tokens.dtype)
        expert_in = torch.einsum("tec,td->ecd", dispatch, tokens)
        num_experts, dim = layer.cfg.expert_count, tokens.size(-1)
        expert_out = layer.experts(expert_in.reshape(-1, dim), [cap] * num_experts).view(num_experts, cap, dim)
        out = torch.einsum("tec,ecd->td", combine, expert_out)
        out.sum().backward()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--skip-one-hot-above", type=int, default=256, help="skip the einsum reference above this E")
    parser.add_argument("--target", type=float, default=1.25, help="largest ratio (median) to 2x dense that passes")
    parser.add_argument("--expert-gemm", default="auto", choices=["auto", "grouped", "loop"],
                        help="the experts' GEMMs: the layer's choice, torch._grouped_mm, or one per expert")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = (args.tokens // 512, 512, args.dim) if args.tokens % 512 == 0 else (1, args.tokens, args.dim)
    place = dict(device=args.device, dtype=DTYPES[args.dtype])
    x = torch.randn(*shape, **place, requires_grad=True)
    dense = FeedForwardNetwork(FFNSpec(args.dim, args.ffn)).to(**place)
    print(f"# {now()} | {device_line(args.device)} | {args.dtype} | load {load_average()} | threads {args.threads} | "
          f"T={args.tokens} d={args.dim} "
          f"ffn={args.ffn} top-2 cf=1.0 | expert GEMMs {args.expert_gemm} | zero_grad(set_to_none=True) for all | "
          f"{args.repeats} interleaved runs")
    layers = {e: MoELayer(MoEConfig(expert_count=e, top_k=2, capacity_factor=1.0, second_expert_policy="all"),
                          FFNSpec(args.dim, args.ffn)).to(**place) for e in args.experts}
    for layer in layers.values():
        layer.experts.grouped_mm = {"auto": None, "grouped": True, "loop": False}[args.expert_gemm]
    samples = interleaved_times([fwd_bwd(dense, x)] + [fwd_bwd(layer, x) for layer in layers.values()], args.repeats)
    best = [min(t) for t in samples]
    median = [statistics.median(t) for t in samples]
    print(f"dense FFN: best {best[0] * 1e3:.0f} ms, median {median[0] * 1e3:.0f} ms")
    print("| E | MoE best (ms) | MoE median (ms) | ratio to 2x dense (best) | ratio (median) | "
          "one-hot einsum (ms) | one-hot ratio |")
    print("|---|---|---|---|---|---|---|")
    for i, (e, layer) in enumerate(layers.items(), start=1):
        if e <= args.skip_one_hot_above:
            t_ref = best_times([one_hot_step(layer, x)], max(1, min(3, args.repeats - 1)))[0]
            ref = f"{t_ref * 1e3:.0f} | {t_ref / (2 * best[0]):.2f}"
        else:
            ref = "skipped | -"
        print(f"| {e} | {best[i] * 1e3:.0f} | {median[i] * 1e3:.0f} | {best[i] / (2 * best[0]):.2f} | "
              f"{median[i] / (2 * median[0]):.2f} | {ref} |", flush=True)
    print(f"growth E={args.experts[0]} -> E={args.experts[-1]}: {100 * (best[-1] / best[1] - 1):+.1f}% (best), "
          f"{100 * (median[-1] / median[1] - 1):+.1f}% (median)")
    ratios = {e: median[i] / (2 * median[0]) for i, e in enumerate(layers, start=1)}
    worst = max(ratios, key=ratios.get)
    verdict = "PASS" if ratios[worst] <= args.target else "FAIL"
    print(f"RESULT MoE layer / 2x dense FFN (median): {', '.join(f'E={e} {r:.2f}' for e, r in ratios.items())}  "
          f"target <= {args.target}: {verdict} (worst E={worst})", flush=True)


if __name__ == "__main__":
    main()
