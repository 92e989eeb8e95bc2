"""``ts-reshard``: convert a checkpoint between tensor-parallel sizes and pipeline splits.

    ts-reshard --input ckpt/checkpoint_last.pt --size 1 --output one/checkpoint_last.pt
    ts-reshard --input pp/checkpoint_last.pt --pipeline-size 1 --output one/checkpoint_last.pt
    ts-reshard --input one/checkpoint_last.pt --pipeline-size 4 --virtual-pipeline-stages 2 --output pp4/checkpoint.pt

``--input`` names the checkpoint as fairseq does (without ``-model_part-K``, ``-stageP`` or
``-shardR``): its files are found as in :mod:`torchscale_fairseq.checkpoints.layout`
(parts ``NAME-model_part-K.pt``, stages ``NAME[-model_part-K]-stageP.pt``, expert shards
``NAME[...]-shardR.pt``, or the single ``NAME.pt``). The output keeps the expert shards and
names the new files ``OUTPUT`` with ``-model_part-K`` and ``-stageP`` for every new rank
(none at size 1). Sharded parameters follow the layout recorded in the checkpoint (split
dimension, Q/K/V stride, padded vocabulary), everything else is copied from part 0. Pipeline
stages are merged into one stack and split again as the flags say (``--pipeline-layers``:
layers per global stage; even by default), the last stage getting a copy of a tied embedding.
Per-parameter optimizer moments (Adam's ``exp_avg``/``exp_avg_sq``, ...) follow their
parameters; an optimizer state that is not per-parameter (fp16's flat master copy) is dropped,
and training continues with ``--reset-optimizer``. The per-rank RNG streams are reseeded.
Checkpoints of ``--zero-sharding full``, ``os`` and none are one format (full tensors, the
unsharded optimizer state): a run resumes under any of the three from any, with nothing to convert.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from torchscale_fairseq.checkpoints.convert import repipeline_grid, reshard_grid
from torchscale_fairseq.checkpoints.layout import file_name, find_checkpoint_files
from torchscale_fairseq.compat.safe_checkpoints import register_safe_globals
from torchscale_fairseq.errors import TsConfigError, install_excepthook
from torchscale_fairseq.integration.checkpoint_loading import read_checkpoint_file
from torchscale_fairseq.model_parallel.pipeline_parallel import parse_layer_counts


def main(argv: list[str] | None = None) -> None:
    """Console entry point ``ts-reshard``."""
    install_excepthook()
    register_safe_globals()
    parser = argparse.ArgumentParser(prog="ts-reshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="checkpoint name, e.g. ckpt/checkpoint_last.pt")
    parser.add_argument("--size", type=int, help="the new --model-parallel-size (default: the checkpoint's)")
    parser.add_argument("--pipeline-size", type=int,
                        help="the new --pipeline-model-parallel-size (default: the checkpoint's stages, unchanged)")
    parser.add_argument("--virtual-pipeline-stages", type=int, help="the new --virtual-pipeline-stages (default 1)")
    parser.add_argument("--pipeline-layers", help="the new --pipeline-layers, e.g. 3,5 (default: an even split)")
    parser.add_argument("--output", required=True, help="new checkpoint name (files get -model_part-K, -stageP)")
    args = parser.parse_args(argv)
    for flag, value in (("--size", args.size), ("--pipeline-size", args.pipeline_size),
                        ("--virtual-pipeline-stages", args.virtual_pipeline_stages)):
        if value is not None and value < 1:
            raise TsConfigError(f"{flag} {value} must be at least 1")
    if not args.input.endswith(".pt") or not args.output.endswith(".pt"):
        raise TsConfigError("--input and --output are checkpoint names ending in .pt")
    files = find_checkpoint_files(args.input, "--input")
    size = args.size or files.tp_size
    repipeline = any(v is not None for v in (args.pipeline_size, args.virtual_pipeline_stages, args.pipeline_layers))
    stages = (args.pipeline_size or files.pp_size) if repipeline else files.pp_size
    grid = {position: read_checkpoint_file(path) for position, path in files.paths.items()}
    names: dict | None = files.paths
    if repipeline and files.pp_size > 1:  # one stack, split again below
        grid, names = repipeline_grid(grid, files.tp_size, files.pp_size, files.ep_size, 1, names=names), None
    pp_now = 1 if repipeline else files.pp_size
    if size != files.tp_size:
        grid, names = reshard_grid(grid, files.tp_size, files.ep_size, size, names, pp_now), None
    if repipeline:
        grid = repipeline_grid(grid, size, 1, files.ep_size, stages, args.virtual_pipeline_stages or 1,
                               parse_layer_counts(args.pipeline_layers))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    for (k, p, r), state in sorted(grid.items()):
        path = file_name(args.output, k, size, r, files.ep_size, p, stages)
        torch.save(state, path)
        print(f"wrote {path}")
    kept = all("last_optimizer_state" in s for s in grid.values())
    note = "optimizer state kept" if kept else "optimizer state dropped: continue training with --reset-optimizer"
    shards = f" x {files.ep_size} expert shards" if files.ep_size > 1 else ""
    print(f"resharded {files.tp_size} -> {size} part(s), {files.pp_size} -> {stages} pipeline stage(s){shards}; "
          f"{note}", file=sys.stderr)


if __name__ == "__main__":
    main()
