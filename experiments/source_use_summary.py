"""Per backbone over seeds, from the rows ``source_use.py --records`` wrote (docs/results.md section 12).

    python experiments/source_use_summary.py RECORDS.jsonl --unigram 461.8 [--plot spread.png]

A run's rows are the ones sharing its ``run`` name. Its *curve* is its rows on the fewest verses (its checkpoints
along training, with the spread at initialisation as update 0); its *final* row is the one on the most verses at
its last update (the whole validation split, for the outcome). Printed, per backbone (mean (min-max) over seeds):

- the encoder spread at each update of the curve (0 = one vector for every source);
- the shuffled / real perplexity ratio and the real perplexity at each update (1.000 = the source is not read);
- the final row: validation perplexity, mean ± sample std (min-max), and the outcome by ``stability.py``'s
  criterion (stalled: not 10% below ``--unigram``; diverged: not finite), shuffled / real, the spread at the end,
  at initialisation, and its smallest value along the curve with the update where it was smallest.

``--plot``: the spread against the update per backbone, mean over seeds with a min-max band (log y).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aggregate import spread  # noqa: E402
from stability import classify  # noqa: E402

from torchscale_fairseq.cli import plot_logs  # noqa: E402

FIELDS = ("run", "backbone", "seed", "lr", "update", "verses", "ppl", "ppl_shuffled", "spread")


def read_records(path: Path) -> list[dict]:
    """The rows of a ``source_use.py --records`` file."""
    if not path.is_file():
        raise SystemExit(f"source_use_summary.py: no records file {path}; write one with "
                         "python experiments/source_use.py ... --records FILE")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            if not all(k in row for k in FIELDS):
                raise KeyError
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"{path}:{n}: not a source_use.py row (a JSON object with {', '.join(FIELDS)}); "
                             "fix or remove that line") from None
        rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no rows; write them with python experiments/source_use.py ... --records {path}")
    return rows


def runs_by_backbone(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """Per backbone, one entry per run: ``{"seed", "curve": {update: row}, "init": spread or None, "final": row}``."""
    by_run: dict[str, list[dict]] = {}
    for row in rows:
        by_run.setdefault(row["run"], []).append(row)
    backbones: dict[str, list[dict]] = {}
    for name in sorted(by_run):
        rs = by_run[name]
        fewest = min(r["verses"] for r in rs)
        curve = {r["update"]: r for r in rs if r["verses"] == fewest}
        inits = [r["spread_init"] for r in curve.values() if "spread_init" in r]
        final = max(rs, key=lambda r: (r["update"], r["verses"]))
        backbones.setdefault(rs[0]["backbone"], []).append(
            {"seed": rs[0]["seed"], "curve": curve, "init": inits[0] if inits else None, "final": final})
    return backbones


def band(values: Sequence[float], fmt: str) -> str:
    """``mean (min-max)`` of ``values`` in format ``fmt`` (one value: itself; none: ``-``)."""
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.fmean(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def curve_points(run: dict) -> dict[int, float]:
    """Update -> encoder spread of one run's curve, with the spread at initialisation as update 0."""
    points = {u: r["spread"] for u, r in run["curve"].items()}
    if run["init"] is not None:
        points[0] = run["init"]
    return points


def curve_tables(backbones: dict[str, list[dict]]) -> list[str]:
    """Markdown: spread, shuffled / real ratio and real ppl per backbone at each update of the curves."""
    updates = sorted({u for runs in backbones.values() for run in runs for u in curve_points(run)})
    verses = sorted({r["verses"] for runs in backbones.values() for run in runs for r in run["curve"].values()})
    head = "| {} | " + " | ".join(str(u) for u in updates) + " |"
    rule = "|---|" + "---|" * len(updates)
    lines = []
    metrics = (
        ("encoder spread", lambda run, u: curve_points(run).get(u), ".2g"),
        ("shuffled / real ppl", lambda run, u: _ratio(run["curve"].get(u)), ".3f"),
        ("ppl", lambda run, u: run["curve"][u]["ppl"] if u in run["curve"] else None, ".1f"),
    )
    for title, value, fmt in metrics:
        lines += [f"{title} at update (first {'/'.join(map(str, verses))} verses; mean (min-max) over seeds)", "",
                  head.format("backbone"), rule]
        for backbone, runs in backbones.items():
            cells = [band([v for v in (value(run, u) for run in runs) if v is not None], fmt) for u in updates]
            lines.append(f"| {backbone} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _ratio(row: dict | None) -> float | None:
    return None if row is None else row["ppl_shuffled"] / row["ppl"]


def final_table(backbones: dict[str, list[dict]], unigram: float) -> list[str]:
    """Markdown: the final rows per backbone (outcome by ``stability.classify``)."""
    lines = [f"final row of each run (outcome: stalled = ppl >= 0.9 x the unigram's {unigram:g})", "",
             "| backbone | seeds | verses | update | valid ppl final | outcome | shuffled / real | spread final "
             "| spread at init | smallest spread (update) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for backbone, runs in backbones.items():
        finals = [run["final"] for run in runs]
        outcomes = [classify({"diverged": not math.isfinite(f["ppl"]), "ppl": f["ppl"]}, unigram) for f in finals]
        counts = ", ".join(f"{o} {outcomes.count(o)}/{len(outcomes)}" for o in sorted(set(outcomes)))
        smallest = [min(curve_points(run).items(), key=lambda p: p[1]) for run in runs]
        lines.append(
            f"| {backbone} | {len(runs)} | {'/'.join(sorted({str(f['verses']) for f in finals}))} "
            f"| {'/'.join(sorted({str(f['update']) for f in finals}))} "
            f"| {spread([f['ppl'] for f in finals], 1)} | {counts} | {band([_ratio(f) for f in finals], '.3f')} "
            f"| {band([f['spread'] for f in finals], '.2g')} "
            f"| {band([run['init'] for run in runs if run['init'] is not None], '.2f')} "
            f"| {', '.join(f'{v:.2g} ({u})' for u, v in smallest)} |")
    return lines


def plot_spread_band(backbones: dict[str, list[dict]], path: Path) -> None:
    """The spread against the update per backbone: the mean over seeds, with a min-max band (log y)."""
    fig, ax = plot_logs.new_figure("encoder spread (mean, min-max over seeds)", "encoder output std over tokens",
                                   log_y=True)
    for backbone, runs in backbones.items():
        points = [curve_points(run) for run in runs]
        updates = sorted({u for p in points for u in p})
        values = [[p[u] for p in points if u in p] for u in updates]
        line = ax.plot(updates, [statistics.fmean(v) for v in values], marker="o", markersize=3, label=backbone)[0]
        ax.fill_between(updates, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                        alpha=0.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_logs.save_figure(fig, ax, path)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", type=Path, help="JSON-lines rows of source_use.py --records")
    p.add_argument("--unigram", type=float, required=True, help="the target unigram model's validation perplexity")
    p.add_argument("--plot", type=Path, help="the spread against the update per backbone (PNG)")
    args = p.parse_args(argv)
    backbones = runs_by_backbone(read_records(args.records))
    print("\n".join(curve_tables(backbones) + final_table(backbones, args.unigram)))
    if args.plot:
        plot_spread_band(backbones, args.plot)


if __name__ == "__main__":
    sys.exit(main())
