"""MFU on a GPU: ``ts_lm_large`` and a 1.3B-parameter config (24 layers, 2048 wide, 16
heads, FFN 8192), bf16 training at sequence 2048, over the bf16 matrix-product rate
measured in the same run (``mfu.py`` with GPU settings; target >= 0.40).

    .venv/bin/python benchmarks/gpu_mfu.py            # on the GPU node (scripts/gpu/run_gpu_check.sh)
    .venv/bin/python benchmarks/gpu_mfu.py --toy      # the same code path at toy size on CPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import mfu

CONFIGS = {  # name: (layers width heads FFN, batch size at sequence 2048)
    "ts_lm_large": ("12 1024 16 4096", 8),
    "1.3B": ("24 2048 16 8192", 4),
}
TARGET = 0.40


def runs(toy: bool, max_update: int) -> dict[str, list[str]]:
    """mfu.py arguments per config."""
    if toy:
        return {"toy": ["--device", "cpu", "--precision", "fp32", "--dims", "2 64 2 128", "--tokens-per-sample", "64",
                        "--batch-size", "2", "--max-update", "3", "--skip-logs", "1", "--rounds", "1",
                        "--gemm", "256x256x256", "--train-tokens", "20000", "--vocab", "500", "--synthetic"]}
    return {name: ["--device", "cuda", "--precision", "bf16", "--dims", dims, "--tokens-per-sample", "2048",
                   "--batch-size", str(batch), "--max-update", str(max_update), "--skip-logs", "3", "--rounds", "1",
                   "--gemm", "8192x8192x8192", "--gemm-reps", "20", "--target", str(TARGET), "--synthetic",
                   "--train-tokens", "400000"]
            for name, (dims, batch) in CONFIGS.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toy", action="store_true", help="tiny model on CPU (checks the code path)")
    p.add_argument("--max-update", type=int, default=12)
    p.add_argument("--only", choices=list(CONFIGS), help="one config")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ts_gpu_mfu_") as shared:  # one corpus for every config
        for name, mfu_args in runs(args.toy, args.max_update).items():
            if args.only and name != args.only:
                continue
            print(f"== {name}: benchmarks/mfu.py {' '.join(mfu_args)}", flush=True)
            mfu.main(mfu_args + ["--workdir", shared])
    return 0


if __name__ == "__main__":
    sys.exit(main())
