"""Model FLOPs utilisation (MFU) of ``ts_lm_large`` training on this machine.

MFU = achieved training FLOP/s / GEMM FLOP/s of ``torch.matmul`` (in the training's
precision, on its device) measured on the same machine in the same run (right before and
right after each training run; the mean of the two is that round's peak).

Training FLOPs per token (matmul FLOPs only; forward 2 per multiply-add, backward 4):

    F = 6 * L * (4 d^2 + 2 d f)      # Q/K/V/out projections and FFN (non-embedding weights)
      + 6 * V * d                    # output layer (tied with the input embedding)
      + 12 * L * T * d               # attention scores Q K^T and weights x V, full T x T
                                     # (PaLM/Megatron convention; causal masking not discounted)

achieved FLOP/s = F * wps, where wps (target tokens per second) comes from fairseq-train's
JSON ``train_inner`` records (``--log-interval 1``, the first ``--skip-logs`` dropped).

    .venv/bin/python benchmarks/mfu.py
    .venv/bin/python benchmarks/mfu.py --device cuda --precision bf16 --tokens-per-sample 2048 \
        --gemm 8192x8192x8192 --target 0.40          # GPU (benchmarks/gpu_speed.py measures issue 43's MFU)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import (
    DTYPES,
    PRECISION_FLAGS,
    REPO,
    USER_DIR,
    decoder_dim_flags,
    device_flags,
    device_line,
    dict_size,
    load_average,
    median,
    now,
    num_params,
    preprocess_lm,
    run,
    tool,
    train_inner_logs,
    write_lm_corpus,
)

LARGE = "12 1024 16 4096"  # ts_lm_large: layers, width, heads, FFN width
DEFAULT_DATA = REPO / "data-bin" / "enwiki_gpt2"
TARGET = 0.7


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help=f"binarized LM data (default: {DEFAULT_DATA} if present, else synthetic)")
    p.add_argument("--synthetic", action="store_true", help="use the synthetic corpus even if data exists")
    p.add_argument("--vocab", type=int, default=10000, help="synthetic corpus: number of distinct words")
    p.add_argument("--train-tokens", type=int, default=100000, help="synthetic corpus: training words")
    p.add_argument("--tokens-per-sample", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-update", type=int, default=2, help="updates per training run")
    p.add_argument("--skip-logs", type=int, default=1, help="warm-up updates dropped per run")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (GEMM peak, training run)")
    p.add_argument("--gemm", default="1024x4096x4096", help="MxKxN of the peak GEMM (M x K @ K x N)")
    p.add_argument("--gemm-reps", type=int, default=8, help="timed GEMMs per peak measurement (after 2 warm-up)")
    p.add_argument("--backbone", default="magneto")
    p.add_argument("--dims", default=LARGE, help="layers, width, heads, FFN width (default: ts_lm_large)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=list(PRECISION_FLAGS), help="training and peak GEMM")
    p.add_argument("--target", type=float, default=TARGET, help="MFU to meet")
    p.add_argument("--extra", default="", help="extra fairseq-train flags (space separated)")
    p.add_argument("--workdir", help="keep data and logs here (default: a temp dir, removed)")
    return p.parse_args(argv)


def gemm_flops_per_s(m: int, k: int, n: int, reps: int, device: str = "cpu", precision: str = "fp32") -> float:
    """Median FLOP/s of ``torch.matmul`` (M x K) @ (K x N) on random data (device synchronised
    around each product)."""
    dtype = DTYPES[precision]
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        torch.matmul(a, b, out=out)
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        torch.matmul(a, b, out=out)
        sync()
        times.append(time.perf_counter() - t)
    return 2.0 * m * k * n / statistics.median(times)


def flops_per_token(vocab: int, seq: int, dims: str = LARGE) -> dict:
    layers, dim, _, ffn = (int(x) for x in dims.split())
    dense = 6 * layers * (4 * dim * dim + 2 * dim * ffn)
    output = 6 * vocab * dim
    attention = 12 * layers * seq * dim
    return {"dense": dense, "output": output, "attention": attention, "total": dense + output + attention}


def train_cmd(data: Path, args) -> list:
    return [
        tool("fairseq-train"), str(data), "--user-dir", str(USER_DIR),
        "--task", "language_modeling", "--tokens-per-sample", str(args.tokens_per_sample),
        "--sample-break-mode", "none",
        "--arch", "ts_lm_large", *decoder_dim_flags(args.dims), "--backbone", args.backbone,
        "--share-decoder-input-output-embed", "--dropout", "0.1",
        *device_flags(args.device), *PRECISION_FLAGS[args.precision], "--optimizer", "adam", "--lr", "5e-4",
        "--batch-size", str(args.batch_size),
        "--max-update", str(args.max_update), "--log-format", "json", "--log-interval", "1",
        "--disable-validation", "--no-save", "--save-dir", str(data.parent / "checkpoints"), "--seed", "1",
        *args.extra.split(),
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    m, k, n = (int(x) for x in args.gemm.lower().split("x"))
    with tempfile.TemporaryDirectory(prefix="ts_bench_mfu_") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = Path(args.data) if args.data else DEFAULT_DATA
        if args.synthetic or not (data / "dict.txt").exists():
            if args.data and not args.synthetic:
                raise SystemExit(f"--data {data}: no dict.txt there")
            text = write_lm_corpus(work / "text", args.vocab, args.train_tokens)
            data = preprocess_lm(text, work / "data-bin")
            source = f"synthetic Zipf corpus, {args.train_tokens} train words"
        else:
            source = str(data)
        vocab = dict_size(data) + 4  # fairseq's <s> <pad> </s> <unk>
        f = flops_per_token(vocab, args.tokens_per_sample, args.dims)
        print(f"date: {now()}")
        print(f"device: {device_line(args.device)}; precision {args.precision}; dims (L d heads FFN) {args.dims}")
        print(f"data: {source}; vocabulary V={vocab}; torch threads {torch.get_num_threads()}")
        print("command: " + " ".join(train_cmd(Path("DATA"), args)))
        print(f"FLOPs/token: dense {f['dense'] / 1e9:.3f} G + output {f['output'] / 1e9:.3f} G + "
              f"attention {f['attention'] / 1e9:.3f} G = {f['total'] / 1e9:.3f} GFLOP")
        peaks, achieved, mfus = [], [], []
        before = gemm_flops_per_s(m, k, n, args.gemm_reps, args.device, args.precision)
        for r in range(args.rounds):
            load = load_average()
            out = run(train_cmd(data, args), log=work / f"train_{r}.log")
            after = gemm_flops_per_s(m, k, n, args.gemm_reps, args.device, args.precision)
            records = train_inner_logs(out)[args.skip_logs:]
            if not records:
                raise SystemExit("no train_inner records left after --skip-logs")
            wps = statistics.mean(float(x["wps"]) for x in records)
            peak = (before + after) / 2
            flops = wps * f["total"]
            peaks.append(peak)
            achieved.append(flops)
            mfus.append(flops / peak)
            params = num_params(out)
            print(f"round {r + 1}: GEMM {m}x{k}@{k}x{n} before {before / 1e9:.1f} after {after / 1e9:.1f} GFLOP/s; "
                  f"train {wps:.1f} wps = {flops / 1e9:.1f} GFLOP/s; MFU {flops / peak:.3f} "
                  f"(params {params:,}; load avg before: {load})", flush=True)
            before = after
        mfu = median(mfus)
        verdict = "PASS" if mfu >= args.target else "FAIL"
        print(f"median: peak {median(peaks) / 1e9:.1f} GFLOP/s, achieved {median(achieved) / 1e9:.1f} GFLOP/s")
        print(f"RESULT MFU (median of rounds): {mfu:.3f}  target >= {args.target}: {verdict}")
        print(f"finished: {now()}  (logs: {work if args.workdir else 'temp dir, removed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
