"""``ts-reshard``: convert a checkpoint between tensor-parallel sizes.

    ts-reshard --input ckpt/checkpoint_last.pt --size 1 --output one/checkpoint_last.pt

``--input`` names the checkpoint as fairseq does (without ``-model_part-K`` or
``-shardR``): its files are found as in :mod:`torchscale_fairseq.checkpoints.layout`
(parts ``NAME-model_part-K.pt``, expert shards ``NAME[-model_part-K]-shardR.pt``, or the
single ``NAME.pt``). The output keeps the expert shards and names the new parts
``OUTPUT`` with ``-model_part-K`` for every new rank K (none for ``--size 1``). Sharded
parameters follow the layout recorded in the checkpoint (split dimension, Q/K/V stride,
padded vocabulary), everything else is copied from part 0. Per-parameter optimizer
moments (Adam's ``exp_avg``/``exp_avg_sq``, ...) are resharded like their parameters;
an optimizer state that is not per-parameter (fp16's flat master copy) is dropped, and
training continues with ``--reset-optimizer``. The per-rank RNG streams are reseeded.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from torchscale_fairseq.checkpoints.convert import reshard_grid
from torchscale_fairseq.checkpoints.layout import file_name, find_checkpoint_files
from torchscale_fairseq.compat.safe_checkpoints import register_safe_globals
from torchscale_fairseq.errors import TsConfigError, install_excepthook
from torchscale_fairseq.integration.checkpoint_loading import read_checkpoint_file


def main(argv: list[str] | None = None) -> None:
    """Console entry point ``ts-reshard``."""
    install_excepthook()
    register_safe_globals()
    parser = argparse.ArgumentParser(prog="ts-reshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="checkpoint name, e.g. ckpt/checkpoint_last.pt")
    parser.add_argument("--size", type=int, required=True, help="the new --model-parallel-size")
    parser.add_argument("--output", required=True, help="new checkpoint name (parts get -model_part-K)")
    args = parser.parse_args(argv)
    if args.size < 1:
        raise TsConfigError(f"--size {args.size} must be at least 1")
    if not args.input.endswith(".pt") or not args.output.endswith(".pt"):
        raise TsConfigError("--input and --output are checkpoint names ending in .pt")
    files = find_checkpoint_files(args.input, "--input")
    grid = {position: read_checkpoint_file(path) for position, path in files.paths.items()}
    new = reshard_grid(grid, files.tp_size, files.ep_size, args.size, files.paths)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    for (k, r), state in sorted(new.items()):
        path = file_name(args.output, k, args.size, r, files.ep_size)
        torch.save(state, path)
        print(f"wrote {path}")
    kept = all("last_optimizer_state" in s for s in new.values())
    note = "optimizer state resharded" if kept else "optimizer state dropped: continue training with --reset-optimizer"
    shards = f" x {files.ep_size} expert shards" if files.ep_size > 1 else ""
    print(f"resharded {files.tp_size} -> {args.size} part(s){shards}; {note}", file=sys.stderr)


if __name__ == "__main__":
    main()
