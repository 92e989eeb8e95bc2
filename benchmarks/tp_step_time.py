"""Training step time of ``ts_lm`` at ``--model-parallel-size 2`` (2 processes, gloo,
1 thread each) against the single process with 1 and with 2 threads, same data, model
and batch.

Runs alternate (TP=1 x1, TP=1 x2, TP=2, ...) so all see the same machine load; a run's
step time is the median of ``1 / ups`` over its JSON ``train_inner`` records (one per
update) after the first ``--skip``. Recorded, not a target: on one shared CPU the
all-reduces are pure overhead (tensor parallelism pays off across devices).

    .venv/bin/python benchmarks/tp_step_time.py [--rounds 1 --updates 15]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import (
    USER_DIR,
    load_average,
    median,
    now,
    preprocess_lm,
    rendezvous_url,
    tool,
    train_inner_logs,
    write_lm_corpus,
)

MODEL = ["--arch", "ts_lm", "--decoder-layers", "2", "--decoder-embed-dim", "256", "--decoder-attention-heads", "8",
         "--decoder-ffn-embed-dim", "1024", "--backbone", "magneto"]
SETTINGS = ((1, 1), (1, 2), (2, 1))  # (tensor-parallel size, threads per process)


def train(data: Path, save: Path, tp: int, threads: int, updates: int) -> list[dict]:
    args = [tool("fairseq-train"), str(data), "--user-dir", str(USER_DIR), "--task", "language_modeling", *MODEL,
            "--tokens-per-sample", "64", "--batch-size", "8", "--max-update", str(updates), "--optimizer", "adam",
            "--lr", "1e-4", "--dropout", "0.1", "--cpu", "--log-format", "json", "--log-interval", "1", "--no-save",
            "--disable-validation", "--model-parallel-size", str(tp), "--save-dir", str(save)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    init_method = rendezvous_url(save)
    procs = []
    for rank in range(tp):
        dist = [] if tp == 1 else [
            "--distributed-world-size", str(tp), "--distributed-rank", str(rank), "--distributed-no-spawn",
            "--distributed-init-method", init_method, "--distributed-backend", "gloo"]
        procs.append(subprocess.Popen([*args, *dist], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env))
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit("training failed:\n" + "\n".join(o[-2000:] for o in outputs))
    return train_inner_logs(outputs[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--updates", type=int, default=15)
    p.add_argument("--skip", type=int, default=3)
    args = p.parse_args()
    started, load_before = now(), load_average()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = preprocess_lm(write_lm_corpus(root / "raw", vocab=2000, tokens=50000), root / "bin", workers=1)
        times: dict[tuple[int, int], list[float]] = {s: [] for s in SETTINGS}
        for _ in range(args.rounds):
            for tp, threads in SETTINGS:
                records = train(data, root / f"ckpt{tp}", tp, threads, args.updates)[args.skip:]
                times[(tp, threads)].append(median(1.0 / float(r["ups"]) for r in records))
    print(f"started {started}, load average before {load_before}, after {load_average()}")
    print("| setting | processes x threads | median s/update | runs |")
    print("|---|---|---|---|")
    for (tp, threads), runs in times.items():
        print(f"| TP={tp} | {tp} x {threads} | {median(runs):.3f} | {', '.join(f'{t:.3f}' for t in runs)} |")
    base = median(times[(1, 1)])
    print(f"\nTP=2 / TP=1 (1 thread) step time: {median(times[(2, 1)]) / base:.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
