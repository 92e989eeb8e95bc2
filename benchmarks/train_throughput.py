"""Training throughput (words/s) of ``ts_lm`` (Magneto) against fairseq's stock
``transformer_lm`` of the same size, on the same data with the same fairseq-train flags.

Runs alternate (ours, stock, stock, ours, ...) so both see the same machine load; with
``--concurrent`` each round runs ours and stock at the same time instead (for a machine so
shared that the load changes within minutes: both then get the same share of it). Each run's
throughput is the mean ``wps`` of its JSON ``train_inner`` records after the first
``--skip-logs`` (warm-up); the ratio ours/stock is taken per round and the median reported.

    .venv/bin/python benchmarks/train_throughput.py            # synthetic Zipf corpus
    .venv/bin/python benchmarks/train_throughput.py --data data-bin/enwiki_gpt2
    .venv/bin/python benchmarks/train_throughput.py --device cuda --precision bf16 --ts-compile  # GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _common import (
    PRECISION_FLAGS,
    REPO,
    USER_DIR,
    decoder_dim_flags,
    device_flags,
    device_line,
    dict_size,
    load_average,
    now,
    preprocess_lm,
    report_ratios,
    run_together,
    tool,
    train_inner_logs,
    write_lm_corpus,
)


def model_args(name: str, args) -> list:
    """``ours`` (``ts_lm``, Magneto, ``--ts-compile`` if asked) or ``stock`` (``transformer_lm``), same dims."""
    dims = decoder_dim_flags(args.dims)
    if name == "stock":
        return ["--arch", "transformer_lm", *dims]
    return ["--arch", "ts_lm", *dims, "--backbone", "magneto", *(["--ts-compile"] if args.ts_compile else [])]

DEFAULT_DATA = REPO / "data-bin" / "enwiki_gpt2"
TARGET = 1.15


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help=f"binarized LM data (default: {DEFAULT_DATA} if present, else synthetic)")
    p.add_argument("--synthetic", action="store_true", help="use the synthetic corpus even if --data/default exists")
    p.add_argument("--vocab", type=int, default=10000, help="synthetic corpus: number of distinct words")
    p.add_argument("--train-tokens", type=int, default=400000, help="synthetic corpus: training words")
    p.add_argument("--max-update", type=int, default=15, help="updates per run")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--skip-logs", type=int, default=1, help="warm-up train_inner records dropped per run")
    p.add_argument("--rounds", type=int, default=3, help="alternating ours/stock rounds")
    p.add_argument("--concurrent", action="store_true", help="run ours and stock at the same time in each round")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--extra", default="", help="extra fairseq-train flags for both models (space separated)")
    p.add_argument("--dims", default="6 512 8 2048", help="layers, width, heads, FFN width (both models)")
    p.add_argument("--tokens-per-sample", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=list(PRECISION_FLAGS), help="both models")
    p.add_argument("--ts-compile", action="store_true", help="ours with --ts-compile (torch.compile per layer)")
    p.add_argument("--target", type=float, default=TARGET, help="ratio ours/stock to meet")
    p.add_argument("--workdir", help="keep data and logs here (default: a temp dir, removed)")
    return p.parse_args(argv)


def train_cmd(data: Path, model_args, args) -> list:
    return [
        tool("fairseq-train"), str(data), "--user-dir", str(USER_DIR),
        "--task", "language_modeling", "--tokens-per-sample", str(args.tokens_per_sample),
        "--sample-break-mode", "none", *model_args, "--share-decoder-input-output-embed", "--dropout", "0.1",
        *device_flags(args.device), *PRECISION_FLAGS[args.precision], "--optimizer", "adam", "--lr", "5e-4",
        "--batch-size", str(args.batch_size),
        "--max-update", str(args.max_update), "--log-format", "json", "--log-interval", str(args.log_interval),
        "--disable-validation", "--no-save", "--save-dir", str(data.parent / "checkpoints"), "--seed", str(args.seed),
        *args.extra.split(),
    ]


def mean_wps(name: str, out: str, skip: int) -> float:
    records = train_inner_logs(out)
    kept = records[skip:]
    if not kept:
        raise SystemExit(f"{name}: no train_inner records after skipping {skip} (got {len(records)})")
    return statistics.mean(float(r["wps"]) for r in kept)


def measure(data: Path, names, args, logdir: Path, round_no: int) -> dict:
    """Train each of ``names`` (together if ``--concurrent``, else one after the other)."""
    groups = [list(names)] if args.concurrent else [[n] for n in names]
    wps = {}
    for group in groups:
        outs = run_together([train_cmd(data, model_args(n, args), args) for n in group],
                            [logdir / f"train_{n}_{round_no}.log" for n in group])
        for n, out in zip(group, outs):
            wps[n] = mean_wps(n, out, args.skip_logs)
    return wps


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ts_bench_tp_") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = Path(args.data) if args.data else DEFAULT_DATA
        if args.synthetic or not (data / "dict.txt").exists():
            if args.data and not args.synthetic:
                raise SystemExit(f"--data {data}: no dict.txt there")
            text = write_lm_corpus(work / "text", args.vocab, args.train_tokens, args.seed)
            data = preprocess_lm(text, work / "data-bin")
            source = f"synthetic Zipf corpus, {args.train_tokens} train words"
        else:
            source = str(data)
        vocab = dict_size(data)
        print(f"date: {now()}")
        print(f"device: {device_line(args.device)}")
        print(f"data: {source} (dictionary {vocab} entries + 4 specials)")
        print("command (ours): " + " ".join(train_cmd(Path("DATA"), model_args("ours", args), args)))
        print("command (stock): " + " ".join(train_cmd(Path("DATA"), model_args("stock", args), args)))
        print("runs: " + ("ours and stock concurrently in each round" if args.concurrent else "alternating"))
        results = {"ours": [], "stock": []}
        for r in range(args.rounds):
            order = ("ours", "stock") if r % 2 == 0 else ("stock", "ours")
            load = load_average()
            wps = measure(data, order, args, work, r)
            for name in order:
                results[name].append(wps[name])
                print(f"round {r + 1} {name:5s}: {wps[name]:8.1f} wps  (load avg before round: {load})", flush=True)
            print(f"round {r + 1} ratio ours/stock: {results['ours'][-1] / results['stock'][-1]:.3f}", flush=True)
        report_ratios(results, "wps", ".1f", args.target)
        print(f"finished: {now()}  (logs: {work if args.workdir else 'temp dir, removed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
