"""Beam-search generation speed (sentences/s of ``fairseq-generate``) of
``ts_transformer_base`` against fairseq's stock ``transformer`` (6-6 layers, 512, 8 heads,
FFN 2048), on a small synthetic translation pair.

Both models are trained for a few updates on the same data (only to have checkpoints with
non-degenerate weights), then decoded with ``--beam 5`` and a fixed output length
(``--min-len L --max-len-a 0 --max-len-b L``) so both generate exactly the same number of
tokens. Decoding runs alternate (ours, stock, stock, ours, ...), or with ``--concurrent`` run
at the same time in each round (for a heavily shared machine); the ratio is taken per
round and the median reported. The speed is fairseq-generate's own figure (its timer covers
the model's inference step only).

    .venv/bin/python benchmarks/generation.py
    .venv/bin/python benchmarks/generation.py --device cuda --test-pairs 2000 --batch-size 200   # GPU
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from _common import (
    USER_DIR,
    device_flags,
    device_line,
    load_average,
    now,
    preprocess_translation,
    report_ratios,
    run,
    run_together,
    tool,
    write_parallel_corpus,
)

MODELS = {
    "ours": ["--arch", "ts_transformer_base"],
    "stock": ["--arch", "transformer"],
}
TARGET = 1.0
_TRANSLATED = re.compile(
    r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s \(([\d.]+) sentences/s, ([\d.]+) tokens/s\)"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="binarized translation data (src-tgt, with a test split); default: synthetic")
    p.add_argument("--vocab", type=int, default=8000, help="synthetic pair: source words")
    p.add_argument("--train-pairs", type=int, default=5000)
    p.add_argument("--test-pairs", type=int, default=100, help="sentences decoded per run")
    p.add_argument("--train-updates", type=int, default=3, help="training updates before decoding")
    p.add_argument("--train-max-tokens", type=int, default=2048)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--length", type=int, default=20, help="L: every hypothesis has exactly L tokens + EOS")
    p.add_argument("--batch-size", type=int, default=25, help="sentences per decoding batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="training and decoding")
    p.add_argument("--concurrent", action="store_true", help="decode with ours and stock at the same time per round")
    p.add_argument("--workdir", help="keep data, checkpoints and logs here (default: a temp dir, removed)")
    return p.parse_args(argv)


def train_cmd(data: Path, name: str, save_dir: Path, args) -> list:
    return [
        tool("fairseq-train"), str(data), "--user-dir", str(USER_DIR), "--task", "translation",
        *MODELS[name], "--dropout", "0.1", *device_flags(args.device), "--optimizer", "adam", "--lr", "5e-4",
        "--max-tokens", str(args.train_max_tokens), "--max-update", str(args.train_updates),
        "--disable-validation", "--no-epoch-checkpoints", "--save-dir", str(save_dir),
        "--log-format", "json", "--log-interval", "1", "--seed", "1",
    ]


def generate_cmd(data: Path, checkpoint: Path, args) -> list:
    return [
        tool("fairseq-generate"), str(data), "--user-dir", str(USER_DIR), "--task", "translation",
        "--path", str(checkpoint), "--gen-subset", "test", *device_flags(args.device), "--beam", str(args.beam),
        "--batch-size", str(args.batch_size), "--min-len", str(args.length), "--max-len-a", "0",
        "--max-len-b", str(args.length), "--quiet",
    ]


def parse_translated(out: str, log: Path) -> tuple:
    m = _TRANSLATED.search(out)
    if not m:
        raise SystemExit(f"no 'Translated ...' line in the fairseq-generate output (see {log})")
    sentences, tokens, seconds = int(m.group(1).replace(",", "")), int(m.group(2).replace(",", "")), float(m.group(3))
    # fairseq prints sentences/s with 2 decimals only: recompute it from the count and the time
    return sentences, tokens, seconds, sentences / seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ts_bench_gen_") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.data:
            data, source = Path(args.data), args.data
        else:
            write_parallel_corpus(work / "raw", args.vocab,
                                  {"train": args.train_pairs, "valid": 100, "test": args.test_pairs})
            data = preprocess_translation(work / "raw", work / "data-bin")
            source = f"synthetic src-tgt pair, {args.train_pairs} train / {args.test_pairs} test sentences"
        print(f"date: {now()}")
        print(f"device: {device_line(args.device)}")
        print(f"data: {source}")
        checkpoints = {}
        for name in MODELS:
            save_dir = work / f"ckpt_{name}"
            cmd = train_cmd(data, name, save_dir, args)
            checkpoints[name] = save_dir / "checkpoint_last.pt"
            if checkpoints[name].exists():
                print(f"train ({name}): reusing {checkpoints[name]}")
                continue
            print(f"train ({name}): " + " ".join(cmd), flush=True)
            run(cmd, log=work / f"train_{name}.log")
            if not checkpoints[name].exists():
                raise SystemExit(f"training {name} left no {checkpoints[name]}")
        for name in MODELS:
            print(f"generate ({name}): " + " ".join(generate_cmd(data, checkpoints[name], args)))
        print("runs: " + ("ours and stock concurrently in each round" if args.concurrent else "alternating"))
        results = {"ours": [], "stock": []}
        for r in range(args.rounds):
            order = ("ours", "stock") if r % 2 == 0 else ("stock", "ours")
            load = load_average()
            groups = [list(order)] if args.concurrent else [[n] for n in order]
            parsed = {}
            for group in groups:
                logs = [work / f"gen_{n}_{r}.log" for n in group]
                outs = run_together([generate_cmd(data, checkpoints[n], args) for n in group], logs)
                for n, out, log in zip(group, outs, logs):
                    parsed[n] = parse_translated(out, log)
            for name in order:
                sentences, tokens, seconds, sps = parsed[name]
                expected = sentences * (args.length + 1)
                if tokens != expected:
                    raise SystemExit(f"{name} generated {tokens} tokens, expected {expected}: lengths not fixed")
                results[name].append(sps)
                print(f"round {r + 1} {name:5s}: {sentences} sentences ({tokens} tokens) in {seconds:.1f}s = "
                      f"{sps:.2f} sentences/s  (load avg before round: {load})", flush=True)
            print(f"round {r + 1} ratio ours/stock: {results['ours'][-1] / results['stock'][-1]:.3f}", flush=True)
        report_ratios(results, "sentences/s", ".2f", TARGET)
        print(f"finished: {now()}  (logs: {work if args.workdir else 'temp dir, removed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
