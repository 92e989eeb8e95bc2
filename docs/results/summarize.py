"""Markdown table rows of the numbers in docs/results.md, from the runs of docs/results/run.sh.

    python docs/results/summarize.py /tmp/results-work/runs/depth_*

Per run directory (its ``train.log``, ``NAME.out`` beside it, ``bleu_test.txt`` if evaluated):
updates reached, first / minimum / final training loss (base 2), best and final validation
perplexity, largest gradient norm, clipped updates (from fairseq's ``clip`` percentage),
final routing entropy (``moe_entropy``), BLEU / chrF, and whether the run diverged: stopped on
non-finite values, or ended with a training loss more than 1 bit above its minimum.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchscale_fairseq.cli import plot_logs


def _f(x: object) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def summarize(run_dir: Path) -> dict[str, str]:
    log = plot_logs.parse_log(run_dir / "train.log")
    train = plot_logs.training_records(log)
    losses = [v for v in (_f(r.get("loss")) for r in train) if v is not None]
    gnorms = [v for v in (_f(r.get("gnorm")) for r in train) if v is not None]
    updates = max((int(_f(r.get("num_updates")) or 0) for r in train), default=0)
    _, ppl = plot_logs.valid_ppl(log)
    _, clipped = plot_logs.clipped_updates(log)
    entropy = [v for v in (_f(r.get("moe_entropy")) for r in train) if v is not None]
    out = run_dir.parent / f"{run_dir.name}.out"
    text = out.read_text(errors="replace") if out.is_file() else ""
    nonfinite = any(s in text for s in ("FloatingPointError", "Nan/Inf", "nan or inf", "non-finite"))
    nonfinite = nonfinite or any(str(r.get("loss")).lower() in ("nan", "inf") for r in train)
    diverged = nonfinite or (bool(losses) and losses[-1] > min(losses) + 1.0)
    scores = {}
    bleu = run_dir / "bleu_test.txt"
    if bleu.is_file():
        for line in bleu.read_text().splitlines():
            key, _, value = line.partition(" ")
            scores[key] = value
    fmt = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    return {
        "run": run_dir.name,
        "updates": str(updates),
        "train loss first/min/final": "/".join(fmt(v) for v in (
            losses[0] if losses else None, min(losses) if losses else None, losses[-1] if losses else None)),
        "valid ppl best": fmt(min(ppl) if ppl else None, 1),
        "valid ppl final": fmt(ppl[-1] if ppl else None, 1),
        "max gnorm": fmt(max(gnorms) if gnorms else None),
        "clipped updates": fmt(clipped[-1] if clipped else None, 0),
        "routing entropy": fmt(entropy[-1] if entropy else None, 3),
        "BLEU": scores.get("bleu", "-"),
        "chrF": scores.get("chrf", "-"),
        "diverged": ("yes (non-finite)" if nonfinite else "yes") if diverged else "no",
    }


def main(argv: list[str]) -> None:
    rows = []
    for a in argv:
        try:
            rows.append(summarize(Path(a)))
        except plot_logs.LogError as e:  # not started yet, or no train.log
            print(f"skipped {a}: {e}", file=sys.stderr)
    if not rows:
        sys.exit("no run directories with a train.log given")
    keys = [k for k in rows[0] if any(r[k] != "-" for r in rows)]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(r[k] for k in keys) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
