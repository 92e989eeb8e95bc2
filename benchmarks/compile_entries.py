"""How many graphs ``--ts-compile`` makes, and whether every layer runs compiled: a model trained and
validated (``torch.no_grad``, eval mode) on batches of three shapes, layers compiled with dynamo and
``aot_eager`` (inductor's tracing without its code generation, so this runs on a CPU in seconds).
MoE experts on grouped GEMMs in bf16, as on a Hopper GPU. Prints one JSON line: dynamo's unique graphs
and its frames (``ok`` below ``total``: a layer hit the recompile limit and ran eager).

    python benchmarks/compile_entries.py --model lm --layers 12 --moe-freq 1
    python benchmarks/compile_entries.py --model mt --layers 1 --moe-freq 1
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers.model_utils import build, dictionary  # noqa: E402  (from this checkout)
from torchscale_fairseq.modules.moe.aux_loss import aux_loss_scales, set_aux_loss_scale  # noqa: E402
from torchscale_fairseq.modules.moe.experts import GroupedExperts  # noqa: E402
from torchscale_fairseq.modules.moe.layer import MoELayer  # noqa: E402

SHAPES = [(4, 11, 13), (3, 15, 9), (5, 7, 17)]  # (sentences, source length, target length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("lm", "mt"), default="lm")
    parser.add_argument("--layers", type=int, default=12, help="layers (of the encoder and of the decoder for mt)")
    parser.add_argument("--moe-freq", type=int, default=1, help="every n-th FFN an MoE layer (0: dense)")
    args = parser.parse_args()
    torch.compile = functools.partial(torch.compile, backend="aot_eager")
    torch.set_num_threads(1)
    d = dictionary()
    moe = dict(moe_expert_count=4, moe_freq=args.moe_freq, moe_second_expert_policy="all") if args.moe_freq else {}
    sizes = dict(decoder_layers=args.layers, decoder_embed_dim=32, decoder_ffn_embed_dim=64)
    if args.model == "mt":
        sizes.update(encoder_layers=args.layers, encoder_embed_dim=32, encoder_ffn_embed_dim=64)
    torch.manual_seed(1)
    model = build(args.model, d, **sizes, **moe, ts_compile=True)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.grouped_mm = True
    model = model.bfloat16()
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    g = torch.Generator().manual_seed(0)
    counters.clear()
    start = time.perf_counter()
    for n, s, t in SHAPES:
        tokens = torch.randint(d.nspecial, len(d), (n, t), generator=g)
        inputs = ((torch.randint(d.nspecial, len(d), (n, s), generator=g), torch.full((n,), s), tokens)
                  if args.model == "mt" else (tokens,))
        model.train()
        (scale,) = aux_loss_scales([16], [False], 0.01, 0.0, 1.0, torch.device("cpu"))
        set_aux_loss_scale(moe_layers, scale)
        logits, _ = model(*inputs)
        logits.float().sum().backward()
        set_aux_loss_scale(moe_layers, None)
        model.eval()
        with torch.no_grad():
            model(*inputs)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(json.dumps({"model": args.model, "layers": args.layers, "moe_layers": len(moe_layers),
                      "graphs": counters["stats"]["unique_graphs"], "frames": dict(counters["frames"]),
                      "recompile_limit": torch._dynamo.config.recompile_limit,
                      "seconds": round(time.perf_counter() - start, 1), "commit": commit,
                      "torch": torch.__version__, "machine": platform.node()}))


if __name__ == "__main__":
    main()
