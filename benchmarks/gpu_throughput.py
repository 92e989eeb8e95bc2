"""Training tokens/s on a GPU: ``ts_lm`` (Magneto) against stock fairseq ``transformer_lm``
with the same dimensions, flags and precision, eager (target >= 1.0) and with
``--ts-compile`` on ours (target >= 1.15): ``train_throughput.py`` with GPU settings.

Steady state: the synthetic corpus is 27 updates per epoch, and the mean is taken over updates
31-80 of each run (the same window for both models), after compilation and after the first
epoch's last batch, whose fewer than 8 sequences recompile the layer once on CUDA (inductor guards
``8 <= B``; 5 s, once per run; measured 2026-11-27 on an H100).

    .venv/bin/python benchmarks/gpu_throughput.py          # on the GPU node
    .venv/bin/python benchmarks/gpu_throughput.py --toy    # the same code path at toy size on CPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import train_throughput

TARGETS = {"eager": 1.0, "ts-compile": 1.15}


def common(toy: bool, precision: str, rounds: int, max_update: int) -> list[str]:
    if toy:
        return ["--device", "cpu", "--precision", "fp32", "--dims", "2 64 2 128", "--tokens-per-sample", "64",
                "--batch-size", "4", "--max-update", "4", "--log-interval", "2", "--skip-logs", "1", "--rounds", "1",
                "--train-tokens", "20000", "--vocab", "500", "--synthetic"]
    return ["--device", "cuda", "--precision", precision, "--dims", "12 1024 16 4096", "--tokens-per-sample", "1024",
            "--batch-size", "16", "--max-update", str(max_update), "--log-interval", "5", "--skip-logs", "6",
            "--rounds", str(rounds), "--train-tokens", "400000", "--synthetic"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toy", action="store_true", help="tiny model on CPU (checks the code path)")
    p.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-update", type=int, default=80, help="updates per run (the first 30 are not timed)")
    p.add_argument("--only", choices=list(TARGETS), help="one of the two comparisons")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ts_gpu_tp_") as shared:  # one corpus for both comparisons
        for name, target in TARGETS.items():
            if args.only and name != args.only:
                continue
            flags = [*common(args.toy, args.precision, args.rounds, args.max_update), "--target", str(target)]
            if name == "ts-compile":
                flags.append("--ts-compile")
            print(f"== {name}: benchmarks/train_throughput.py {' '.join(flags)}", flush=True)
            train_throughput.main(flags + ["--workdir", shared])
    return 0


if __name__ == "__main__":
    sys.exit(main())
