"""``ts-consolidate-experts``: merge the per-rank shards of an expert-parallel checkpoint
(``checkpoint_X-shard<r>.pt``, or ``checkpoint_X-model_part-<k>-stage<p>-shard<r>.pt`` under
tensor and pipeline parallelism) into one checkpoint per tensor-parallel part and pipeline stage, which
``fairseq-generate`` and ``fairseq-eval-lm`` load on a single process (or on one process
per part; ``ts-reshard --size 1 --pipeline-size 1`` makes the parts and stages one file).

Each shard's rank comes from the layout it records (:mod:`torchscale_fairseq.checkpoints`);
the expert tensors of the ranks of one all-to-all group are concatenated along the expert
dimension, dense tensors are taken from rank 0. Shards are refused with a one-line error
unless they come from one run and one step: same model settings, same update count,
identical dense weights, identical expert replicas, and exactly one shard for every rank.
The optimizer state (sharded) is not kept.

Usage: ``ts-consolidate-experts CHECKPOINT_DIR/checkpoint_best.pt -o OUT.pt`` (the shards
``checkpoint_best[-model_part-K][-stageP]-shard*.pt`` are found; parts and stages are written as
``OUT[-model_part-K][-stageP].pt``) or ``ts-consolidate-experts SHARD... -o OUT.pt`` (the shards of
one part).
"""

from __future__ import annotations

import argparse
import os
import sys

from torchscale_fairseq.checkpoints.convert import consolidate, consolidate_grid
from torchscale_fairseq.checkpoints.layout import file_name, find_checkpoint_files
from torchscale_fairseq.compat.safe_checkpoints import register_safe_globals
from torchscale_fairseq.errors import TsConfigError, install_excepthook
from torchscale_fairseq.integration.checkpoint_loading import read_checkpoint_file


def main(argv: list[str] | None = None) -> None:
    install_excepthook()
    register_safe_globals()
    parser = argparse.ArgumentParser(prog="ts-consolidate-experts", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="the shards, or the checkpoint name without -shardN")
    parser.add_argument("-o", "--output", required=True, help="consolidated checkpoint to write")
    args = parser.parse_args(argv)
    from fairseq import checkpoint_utils

    if len(args.checkpoints) == 1 and not os.path.exists(args.checkpoints[0]):
        files = find_checkpoint_files(args.checkpoints[0], "the path")
        grid = {position: read_checkpoint_file(path) for position, path in files.paths.items()}
        merged = consolidate_grid(grid, files.tp_size, files.ep_size, files.paths, files.pp_size)
        outputs = {file_name(args.output, k, files.tp_size, 0, 1, p, files.pp_size): state
                   for (k, p, _), state in merged.items()}
        count = len(files.paths)
    else:
        for name in args.checkpoints:
            if not os.path.isfile(name):
                raise TsConfigError(f"{name} does not exist")
        states = [read_checkpoint_file(n) for n in args.checkpoints]
        outputs = {args.output: consolidate(states, args.checkpoints)}
        count = len(states)
    for path, state in outputs.items():
        checkpoint_utils.torch_persistent_save(state, path)
    print(f"consolidated {count} shards into {', '.join(outputs)}", file=sys.stderr)


if __name__ == "__main__":
    main()
