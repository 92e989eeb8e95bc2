"""``ts-plot-logs``: PNG plots from the ``--log-format json`` output of one or more fairseq runs.

Each LOG is a file holding fairseq-train's console output (e.g. ``train.log`` written by the
``scripts/`` recipes with ``tee``); one line is drawn per run. Written to ``--out-dir``:

* ``valid_ppl.png``: validation perplexity against updates (TorchScale paper Figures 1-2);
Training curves use the per-interval ``train_inner`` records, or the per-epoch ``train``
records when a run logged no interval (fewer updates than ``--log-interval``).

* ``routing_entropy.png``: routing entropy (training log keys containing ``entropy``, e.g.
  ``moe_entropy`` of the MoE criterions) against updates (Figure 4);
* ``clipping.png``: cumulative number of clipped updates against updates, from fairseq's
  ``clip`` key (percentage of updates in each logging interval whose gradient norm was
  clipped; logged only with ``--clip-norm`` > 0).

A plot whose keys are in none of the logs is skipped with a note; a log with no fairseq JSON
records at all is an error.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

TAGS = ("train_inner", "valid", "train")


@dataclass
class RunLog:
    """The JSON records of one run, by kind (``train_inner``, ``valid``, ``train``)."""

    label: str
    records: dict[str, list[dict]] = field(default_factory=lambda: {tag: [] for tag in TAGS})


class LogError(ValueError):
    """A log file that cannot be used."""


def parse_log(path: Path, label: str | None = None) -> RunLog:
    """Read fairseq JSON progress records (``... | valid | {...}``) from a console log."""
    if not path.is_file():
        raise LogError(f"log file {path} does not exist")
    run = RunLog(label or (path.parent.name if path.name in ("train.log", "log.txt") else path.stem))
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            start = line.find("{")
            if start < 0:
                continue
            tag = next((t for t in TAGS if f"| {t} |" in line[:start]), None)
            if tag is None:
                continue
            try:
                record = json.loads(line[start:])
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                run.records[tag].append(record)
    if not any(run.records.values()):
        raise LogError(f"{path} holds no fairseq JSON log records; train with --log-format json")
    return run


def _number(value: object) -> float | None:
    try:
        x = float(value)  # fairseq writes numbers as strings
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def series(records: list[dict], key: str, updates_key: str) -> tuple[list[float], list[float]]:
    """(updates, values) of ``key`` over the records that have both numbers."""
    xs, ys = [], []
    for record in records:
        x, y = _number(record.get(updates_key)), _number(record.get(key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def valid_ppl(run: RunLog) -> tuple[list[float], list[float]]:
    """Validation perplexity against updates."""
    return series(run.records["valid"], "valid_ppl", "valid_num_updates")


def training_records(run: RunLog) -> list[dict]:
    """Per-interval training records, or the per-epoch ones (``train_`` prefix removed) if there are none."""
    if run.records["train_inner"]:
        return run.records["train_inner"]
    return [{k.removeprefix("train_"): v for k, v in r.items()} for r in run.records["train"]]


def entropy_keys(run: RunLog) -> list[str]:
    """Training keys that hold a routing entropy."""
    return sorted({k for r in training_records(run) for k in r if "entropy" in k})


def clipped_updates(run: RunLog) -> tuple[list[float], list[float]]:
    """Cumulative number of clipped updates against updates, from the per-interval ``clip`` percentage."""
    xs, ys = [], []
    previous, total = 0.0, 0.0
    for record in training_records(run):
        updates, clip = _number(record.get("num_updates")), _number(record.get("clip"))
        if updates is None or clip is None:
            continue
        total += clip / 100.0 * max(updates - previous, 0.0)
        previous = updates
        xs.append(updates)
        ys.append(round(total, 6))
    return xs, ys


def new_figure(title: str, ylabel: str, log_y: bool = False):  # noqa: ANN202 (matplotlib types)
    """A matplotlib (figure, axes) with updates on x, ``ylabel`` on y (log scale if ``log_y``)."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    ax.set_title(title)
    ax.set_xlabel("updates")
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    return fig, ax


def save_figure(fig, ax, path: Path) -> Path:  # noqa: ANN001
    """Add the legend, write ``fig`` to ``path`` as PNG and close it."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_runs(runs: list[RunLog], out_dir: Path) -> tuple[list[Path], list[str]]:
    """Write the PNGs for ``runs`` into ``out_dir``; return (written files, notes on skipped plots)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    notes: list[str] = []

    curves = [(run.label, *valid_ppl(run)) for run in runs]
    if any(xs for _, xs, _ in curves):
        fig, ax = new_figure("Validation perplexity", "perplexity", log_y=True)
        for label, xs, ys in curves:
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=label)
        written.append(save_figure(fig, ax, out_dir / "valid_ppl.png"))
    else:
        notes.append("valid_ppl.png skipped: no 'valid_ppl' in the logs (validation never ran?)")

    entropy = [(run.label, key, *series(training_records(run), key, "num_updates"))
               for run in runs for key in entropy_keys(run)]
    if any(xs for *_, xs, _ in entropy):
        fig, ax = new_figure("Routing entropy", "entropy")
        for label, key, xs, ys in entropy:
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=f"{label} ({key})" if key != "moe_entropy" else label)
        written.append(save_figure(fig, ax, out_dir / "routing_entropy.png"))
    else:
        notes.append("routing_entropy.png skipped: no '*entropy*' key in the training logs (no MoE run?)")

    clips = [(run.label, *clipped_updates(run)) for run in runs]
    if any(xs for _, xs, _ in clips):
        fig, ax = new_figure("Clipped updates", "number of clipped updates (cumulative)")
        for label, xs, ys in clips:
            if xs:
                ax.plot([0.0, *xs], [0.0, *ys], marker="o", markersize=3, label=label)
        written.append(save_figure(fig, ax, out_dir / "clipping.png"))
    else:
        notes.append("clipping.png skipped: no 'clip' key in the training logs (trained without --clip-norm?)")
    return written, notes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="ts-plot-logs", description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="fairseq console logs written with --log-format json")
    parser.add_argument("--labels", nargs="+", help="one legend label per log (default: the run directory name)")
    parser.add_argument("--out-dir", default="plots", help="directory for the PNGs (default plots)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """Entry point: parse the logs, write the plots, print what was written."""
    args = parse_args(argv)
    if args.labels and len(args.labels) != len(args.logs):
        raise SystemExit(f"error: {len(args.labels)} --labels for {len(args.logs)} logs")
    labels = args.labels or [None] * len(args.logs)
    try:
        runs = [parse_log(Path(log), label) for log, label in zip(args.logs, labels)]
    except LogError as err:
        raise SystemExit(f"error: {err}") from err
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise SystemExit("error: matplotlib is not installed; fix: pip install matplotlib") from err
    written, notes = plot_runs(runs, Path(args.out_dir))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
