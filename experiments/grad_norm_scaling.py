"""SparseClip's premise against the number of experts: the ratio of the expert to the dense gradient
norm, ``r = ||g_s|| / ||g_d||`` (fairseq's ``gnorm_expert`` / ``gnorm_dense``, logged every update),
over runs named ``<prefix>_E<experts>_s<seed>`` that differ only in the expert count.

    python experiments/grad_norm_scaling.py /tmp/results-work/runs/clipscale_E*_s* [--plot out.png]
    python experiments/grad_norm_scaling.py --records docs/results/clip/norm_ratio_runs.jsonl   # the committed runs

Per expert count: ``r`` averaged over updates 1-10 (early) and over the last 10 logged updates (late),
mean ± std (min-max) over seeds, and the share of the experts in SparseClip's squared norm,
``(kappa r)^2 / (1 + (kappa r)^2)`` with ``kappa = 1/sqrt(E)`` (TorchScale paper section 2.3). Then the
power law ``r = c E^alpha`` fitted by least squares to ``log r`` over every run (early and late apart),
and its value extrapolated to larger E. ``--plot``: ``r`` against E on log-log axes (mean, min-max
bars, the fitted lines).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aggregate import spread  # noqa: E402

from torchscale_fairseq.cli import plot_logs  # noqa: E402

RUN_NAME = re.compile(r"^.+_E(?P<experts>\d+)_s(?P<seed>\d+)$")
WINDOW = 10  # updates averaged at the start and at the end
EXTRAPOLATE = (1024, 4096)


def run_records(run_dir: Path) -> list[dict]:
    """A run directory's logged training records."""
    return plot_logs.training_records(plot_logs.parse_log(run_dir / "train.log"))


def ratios(records: Sequence[dict], name: str) -> tuple[float, float]:
    """(early, late) mean of ``gnorm_expert / gnorm_dense`` over the first and last WINDOW updates of one run's
    logged records (:func:`run_records`, or a ``runs.jsonl`` line's ``train`` list)."""
    values = []
    for r in records:
        try:
            dense, expert = float(r["gnorm_dense"]), float(r["gnorm_expert"])
        except (KeyError, TypeError, ValueError):
            continue
        if dense > 0 and math.isfinite(expert):
            values.append(expert / dense)
    if len(values) < 2 * WINDOW:
        raise SystemExit(f"{name}: {len(values)} updates with gnorm_dense/gnorm_expert, need {2 * WINDOW} "
                         "(train with SparseClip and --log-interval 1)")
    return statistics.fmean(values[:WINDOW]), statistics.fmean(values[-WINDOW:])


def fit_power_law(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(c, alpha) of ``r = c E^alpha``, least squares on (log E, log r)."""
    xs = [math.log(e) for e, _ in points]
    ys = [math.log(r) for _, r in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    alpha = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my - alpha * mx), alpha


def expert_share(r: float, experts: int) -> float:
    """The experts' part of SparseClip's squared norm when ``||g_s|| = r ||g_d||``."""
    weighted = r / math.sqrt(experts)
    return weighted**2 / (1 + weighted**2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories <prefix>_E<experts>_s<seed>")
    parser.add_argument("--records", type=Path,
                        help="read the runs from this runs.jsonl (aggregate.py --runs-jsonl) instead of run directories")
    parser.add_argument("--plot", type=Path, help="write the log-log plot of r against E here (PNG)")
    args = parser.parse_args(argv)
    if bool(args.runs) == bool(args.records):
        parser.error("give run directories or --records runs.jsonl (one of the two)")
    if args.records:
        lines = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
        runs = [(line["run"], line["train"]) for line in lines]
    else:
        runs = [(d.name, run_records(d)) for d in args.runs]
    by_experts: dict[int, list[tuple[float, float]]] = {}
    for name, records in runs:
        match = RUN_NAME.match(name)
        if match is None:
            raise SystemExit(f"{name}: not named <prefix>_E<experts>_s<seed>")
        by_experts.setdefault(int(match["experts"]), []).append(ratios(records, name))
    counts = sorted(by_experts)
    print("| experts | seeds | r early (updates 1-10) | r late (last 10) | experts' share of the SparseClip norm^2, late (%) |")
    print("|---|---|---|---|---|")
    for e in counts:
        early, late = [r[0] for r in by_experts[e]], [r[1] for r in by_experts[e]]
        share = [100 * expert_share(r, e) for r in late]
        print(f"| {e} | {len(late)} | {spread(early, 3)} | {spread(late, 3)} | {spread(share, 3)} |")
    fits = {}
    for phase, index in (("early", 0), ("late", 1)) if len(counts) > 1 else ():
        points = [(e, r[index]) for e in counts for r in by_experts[e]]
        c, alpha = fit_power_law(points)
        fits[phase] = (c, alpha)
        far = ", ".join(f"E={e}: r={c * e**alpha:.3g} (share {100 * expert_share(c * e**alpha, e):.3g}%)"
                        for e in EXTRAPOLATE)
        print(f"\nfit, {phase}: r = {c:.3g} * E^{alpha:.3f}; extrapolated {far}")
    if args.plot:
        fig, ax = plot_logs.new_figure("expert / dense gradient norm against the number of experts",
                                       "||g_expert|| / ||g_dense||", log_y=True)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("experts per MoE layer (E)")
        for phase, index in (("early", 0), ("late", 1)):
            means = [statistics.fmean(r[index] for r in by_experts[e]) for e in counts]
            low = [m - min(r[index] for r in by_experts[e]) for m, e in zip(means, counts)]
            high = [max(r[index] for r in by_experts[e]) - m for m, e in zip(means, counts)]
            (line,) = ax.plot(counts, means, marker="o", linestyle="none", label=f"{phase} (mean, min-max)")
            ax.errorbar(counts, means, yerr=[low, high], fmt="none", color=line.get_color())
            if phase in fits:
                c, alpha = fits[phase]
                ax.plot(counts, [c * e**alpha for e in counts], color=line.get_color(), linewidth=1,
                        label=f"{phase} fit: {c:.2g} E^{alpha:.2f}")
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_logs.save_figure(fig, ax, args.plot)


if __name__ == "__main__":
    main()
