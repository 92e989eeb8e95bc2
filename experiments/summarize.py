"""Markdown table rows of the numbers in docs/results.md, from the runs of experiments/run.sh.

    python experiments/summarize.py /tmp/results-work/runs/depth_*

Per run directory (its ``train.log``, ``NAME.out`` beside it, ``bleu_test.txt`` if evaluated):
updates reached, first / minimum / final training loss (base 2), best and final validation
perplexity, largest gradient norm, clipped updates (from fairseq's ``clip`` percentage),
loss spikes, the mean expert / dense gradient-norm ratio (``gnorm_expert`` / ``gnorm_dense``, logged
by SparseClip), final routing entropy (``moe_entropy``), BLEU / chrF, the fraction of distinct test
hypotheses (``generate_test.txt``; 1 / N when a model gives every source the same output), and
whether the run diverged: stopped on non-finite values, or ended with a training loss more than 1
bit above its minimum.
A *loss spike* is a logged training loss more than ``SPIKE_BITS`` above the median of the
``SPIKE_WINDOW`` logged losses before it (with ``--log-interval 1``: per update).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from torchscale_fairseq.cli import plot_logs

SPIKE_BITS = 0.5
SPIKE_WINDOW = 10


def _f(x: object) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def loss_spikes(losses: list[float]) -> int:
    """How many losses exceed the median of the ``SPIKE_WINDOW`` before them by more than ``SPIKE_BITS``."""
    return sum(losses[i] > statistics.median(losses[i - SPIKE_WINDOW:i]) + SPIKE_BITS
               for i in range(SPIKE_WINDOW, len(losses)))


def metrics(run_dir: Path) -> dict[str, float | bool | None]:
    """The numbers of one run (``None`` where the log has none); ``diverged``/``nonfinite`` are flags."""
    log = plot_logs.parse_log(run_dir / "train.log")
    train = plot_logs.training_records(log)
    losses = [v for v in (_f(r.get("loss")) for r in train) if v is not None]
    gnorms = [v for v in (_f(r.get("gnorm")) for r in train) if v is not None]
    _, ppl = plot_logs.valid_ppl(log)
    _, clipped = plot_logs.clipped_updates(log)
    entropy = [v for v in (_f(r.get("moe_entropy")) for r in train) if v is not None]
    parts = [(_f(r.get("gnorm_expert")), _f(r.get("gnorm_dense"))) for r in train]
    ratios = [e / d for e, d in parts if e is not None and d]
    out = run_dir.parent / f"{run_dir.name}.out"
    text = out.read_text(errors="replace") if out.is_file() else ""
    nonfinite = any(s in text for s in ("FloatingPointError", "Nan/Inf", "nan or inf", "non-finite"))
    nonfinite = nonfinite or any(str(r.get("loss")).lower() in ("nan", "inf") for r in train)
    scores: dict[str, float | None] = {}
    bleu = run_dir / "bleu_test.txt"
    if bleu.is_file():
        for line in bleu.read_text().splitlines():
            key, _, value = line.partition(" ")
            scores[key] = _f(value)
    generated = run_dir / "generate_test.txt"
    hypotheses = [line.split("\t")[-1] for line in generated.read_text(errors="replace").splitlines()
                  if line.startswith("H-")] if generated.is_file() else []
    return {
        "updates": max((int(_f(r.get("num_updates")) or 0) for r in train), default=0),
        "loss_first": losses[0] if losses else None,
        "loss_min": min(losses) if losses else None,
        "loss_final": losses[-1] if losses else None,
        "ppl_best": min(ppl) if ppl else None,
        "ppl_final": ppl[-1] if ppl else None,
        "gnorm_max": max(gnorms) if gnorms else None,
        "clipped": clipped[-1] if clipped else None,
        "spikes": loss_spikes(losses) if losses else None,
        "norm_ratio": statistics.fmean(ratios) if ratios else None,
        "entropy": entropy[-1] if entropy else None,
        "bleu": scores.get("bleu"),
        "chrf": scores.get("chrf"),
        "distinct": len(set(hypotheses)) / len(hypotheses) if hypotheses else None,
        "nonfinite": nonfinite,
        "diverged": nonfinite or (bool(losses) and losses[-1] > min(losses) + 1.0),
    }


def fmt(v: float | None, places: int = 2) -> str:
    """``v`` with ``places`` decimals, or ``-``."""
    return "-" if v is None else f"{v:.{places}f}"


def summarize(run_dir: Path) -> dict[str, str]:
    """One table row of ``run_dir``."""
    m = metrics(run_dir)
    return {
        "run": run_dir.name,
        "updates": str(m["updates"]),
        "train loss first/min/final": "/".join(fmt(m[k]) for k in ("loss_first", "loss_min", "loss_final")),
        "valid ppl best": fmt(m["ppl_best"], 1),
        "valid ppl final": fmt(m["ppl_final"], 1),
        "max gnorm": fmt(m["gnorm_max"]),
        "clipped updates": fmt(m["clipped"], 0),
        "loss spikes": fmt(m["spikes"], 0),
        "expert / dense norm": fmt(m["norm_ratio"], 3),
        "routing entropy": fmt(m["entropy"], 3),
        "BLEU": fmt(m["bleu"]),
        "chrF": fmt(m["chrf"]),
        "distinct hypotheses": fmt(m["distinct"], 3),
        "diverged": ("yes (non-finite)" if m["nonfinite"] else "yes") if m["diverged"] else "no",
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
