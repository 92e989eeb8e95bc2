"""Beam-search speed on a GPU: ``fairseq-generate`` sentences/s of ``ts_transformer_base``
against stock ``transformer``, beam 5 (target >= 1.0): ``generation.py`` on CUDA.

    .venv/bin/python benchmarks/gpu_generation.py          # on the GPU node
    .venv/bin/python benchmarks/gpu_generation.py --toy    # the same code path at toy size on CPU
"""

from __future__ import annotations

import argparse
import sys

import generation


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toy", action="store_true", help="few sentences on CPU (checks the code path)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if args.toy:
        flags = ["--device", "cpu", "--vocab", "500", "--train-pairs", "300", "--test-pairs", "10",
                 "--train-updates", "1", "--length", "5", "--batch-size", "5", "--rounds", "1"]
    else:
        flags = ["--device", "cuda", "--test-pairs", "1000", "--batch-size", "200", "--train-updates", "20",
                 "--length", "30", "--rounds", str(args.rounds)]
    print(f"== benchmarks/generation.py {' '.join(flags)}", flush=True)
    return generation.main(flags)


if __name__ == "__main__":
    sys.exit(main())
