"""Training throughput (words/s) of ``ts_lm`` (Magneto) against fairseq's stock
``transformer_lm`` of the same size, on the same data with the same fairseq-train flags.

Runs alternate (ours, stock, ours, stock, ...) so both see the same machine load. Each run's
throughput is the mean ``wps`` of its JSON ``train_inner`` records after the first
``--skip-logs`` (warm-up); the ratio ours/stock is taken per round and the median reported.

    .venv/bin/python benchmarks/train_throughput.py            # synthetic Zipf corpus
    .venv/bin/python benchmarks/train_throughput.py --data data-bin/enwiki_gpt2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _common import (
    REPO, USER_DIR, dict_size, load_average, median, now, preprocess_lm, run, tool, train_inner_logs,
    write_lm_corpus,
)

DIMS = ["--decoder-layers", "6", "--decoder-embed-dim", "512", "--decoder-attention-heads", "8",
        "--decoder-ffn-embed-dim", "2048"]
MODELS = {
    "ours": ["--arch", "ts_lm", *DIMS, "--backbone", "magneto"],
    "stock": ["--arch", "transformer_lm", *DIMS],
}
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
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--extra", default="", help="extra fairseq-train flags for both models (space separated)")
    p.add_argument("--workdir", help="keep data and logs here (default: a temp dir, removed)")
    return p.parse_args(argv)


def train_cmd(data: Path, model_args, args) -> list:
    return [
        tool("fairseq-train"), str(data), "--user-dir", str(USER_DIR),
        "--task", "language_modeling", "--tokens-per-sample", "256", "--sample-break-mode", "none",
        *model_args, "--share-decoder-input-output-embed", "--dropout", "0.1",
        "--cpu", "--optimizer", "adam", "--lr", "5e-4", "--batch-size", "8",
        "--max-update", str(args.max_update), "--log-format", "json", "--log-interval", str(args.log_interval),
        "--disable-validation", "--no-save", "--seed", str(args.seed), *args.extra.split(),
    ]


def measure(data: Path, name: str, args, logdir: Path, round_no: int) -> float:
    cmd = train_cmd(data, MODELS[name], args)
    out = run(cmd, log=logdir / f"train_{name}_{round_no}.log")
    records = train_inner_logs(out)
    kept = records[args.skip_logs:]
    if not kept:
        raise SystemExit(f"{name}: no train_inner records after skipping {args.skip_logs} (got {len(records)})")
    wps = [float(r["wps"]) for r in kept]
    return statistics.mean(wps)


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
        print(f"data: {source} (dictionary {vocab} entries + 4 specials)")
        print("command (ours): " + " ".join(train_cmd(Path("DATA"), MODELS["ours"], args)))
        print("command (stock): " + " ".join(train_cmd(Path("DATA"), MODELS["stock"], args)))
        results = {"ours": [], "stock": []}
        for r in range(args.rounds):
            order = ("ours", "stock") if r % 2 == 0 else ("stock", "ours")
            for name in order:
                load = load_average()
                wps = measure(data, name, args, work, r)
                results[name].append(wps)
                print(f"round {r + 1} {name:5s}: {wps:8.1f} wps  (load avg before: {load})", flush=True)
            print(f"round {r + 1} ratio ours/stock: {results['ours'][-1] / results['stock'][-1]:.3f}", flush=True)
        ratios = [o / s for o, s in zip(results["ours"], results["stock"])]
        ratio = median(ratios)
        print(f"median wps ours: {median(results['ours']):.1f}  stock: {median(results['stock']):.1f}")
        print(f"ratios per round: {', '.join(f'{x:.3f}' for x in ratios)}")
        verdict = "PASS" if ratio >= TARGET else "FAIL"
        print(f"RESULT ratio ours/stock (median of rounds): {ratio:.3f}  target >= {TARGET}: {verdict}")
        print(f"finished: {now()}  (logs: {work if args.workdir else 'temp dir, removed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
