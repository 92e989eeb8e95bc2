"""Which runs of a learning-rate x depth grid train, and the largest learning rate that does (issue 25
item 1, the DeepNet / Magneto stability claim), over runs named
``<prefix>_<backbone>_L<layers>_lr<lr>_s<seed>``.

    python docs/results/stability.py /tmp/results-work/runs/stab_*_s[0-9]* --unigram 687 [--plot out.png]
    python docs/results/stability.py RUN_DIR --unigram 687 --outcome     # one run: trains|stalled|diverged

Criteria, fixed before any run: a run **diverged** when it stopped on non-finite values or ended
with a training loss more than 1 bit above its minimum (``summarize.py``); it **stalled** when its
final validation perplexity is not at least 10% below the unigram model's (``--unigram``: a model
there learnt only the token frequencies); it **trains** otherwise. ``lr_max`` of a backbone at a
depth, per seed: the largest learning rate of the grid at which that seed trains (``-`` where none
does). Printed: one row per backbone and depth, one column per learning rate (seeds that train /
seeds run, and the final validation perplexity, mean ± std (min-max)), then ``lr_max`` (median
and min-max over seeds). ``--plot``: ``lr_max`` against depth per backbone (log axes), as the
DeepNet and Magneto papers draw it, once the grid has more than one learning rate.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aggregate import spread  # noqa: E402
from summarize import metrics  # noqa: E402

from torchscale_fairseq.cli import plot_logs  # noqa: E402

RUN_NAME = re.compile(r"^.+_(?P<backbone>[a-z]+)_L(?P<layers>\d+)_lr(?P<lr>[0-9.e-]+)_s(?P<seed>\d+)$")
STALL_MARGIN = 0.9  # trains: final validation perplexity below 0.9 x the unigram model's


def outcome(run_dir: Path, unigram_ppl: float) -> tuple[str, float | None]:
    """(``trains`` | ``stalled`` | ``diverged``, final validation perplexity) of one run."""
    m = metrics(run_dir)
    if m["diverged"]:
        return "diverged", m["ppl_final"]
    if m["ppl_final"] is None or m["ppl_final"] >= STALL_MARGIN * unigram_ppl:
        return "stalled", m["ppl_final"]
    return "trains", m["ppl_final"]


def lr_max(outcomes: dict[float, str]) -> float | None:
    """The largest learning rate whose outcome is ``trains`` (``None``: none)."""
    trained = [lr for lr, o in outcomes.items() if o == "trains"]
    return max(trained) if trained else None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories <prefix>_<backbone>_L<layers>_lr<lr>_s<seed>")
    parser.add_argument("--unigram", type=float, required=True, help="the unigram model's validation perplexity")
    parser.add_argument("--plot", type=Path, help="write lr_max against depth (PNG) here")
    parser.add_argument("--outcome", action="store_true", help="print each run's outcome, one per line (no table)")
    args = parser.parse_args(argv)
    if args.outcome:
        for run_dir in args.runs:
            print(outcome(run_dir, args.unigram)[0])
        return
    # (backbone, layers) -> seed -> lr -> (outcome, ppl)
    grid: dict[tuple[str, int], dict[int, dict[float, tuple[str, float | None]]]] = {}
    for run_dir in args.runs:
        match = RUN_NAME.match(run_dir.name)
        if match is None:
            raise SystemExit(f"{run_dir.name}: not named <prefix>_<backbone>_L<layers>_lr<lr>_s<seed>")
        cell = grid.setdefault((match["backbone"], int(match["layers"])), {})
        cell.setdefault(int(match["seed"]), {})[float(match["lr"])] = outcome(run_dir, args.unigram)
    lrs = sorted({lr for cell in grid.values() for seeds in cell.values() for lr in seeds})
    print(f"trains: final validation ppl < {STALL_MARGIN} x {args.unigram:g} (unigram) = "
          f"{STALL_MARGIN * args.unigram:.1f}, no divergence\n")
    print("| backbone | layers | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | lr_max (median, min-max) |")
    print("|---|---|" + "---|" * len(lrs) + "---|")
    maxima: dict[str, list[tuple[int, float]]] = {}
    for (backbone, layers), cell in sorted(grid.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        columns = []
        for lr in lrs:
            runs = [seeds[lr] for seeds in cell.values() if lr in seeds]
            if not runs:
                columns.append("-")
                continue
            ppl = spread([p for _, p in runs if p is not None], 1)
            kinds = [o for o, _ in runs]
            note = ", ".join(f"{kinds.count(k)} {k}" for k in ("stalled", "diverged") if k in kinds)
            columns.append(f"{kinds.count('trains')}/{len(runs)} trains{f' ({note})' if note else ''}; ppl {ppl}")
        per_seed = [lr_max({lr: o for lr, (o, _) in seeds.items()}) for seeds in cell.values()]
        found = [x for x in per_seed if x is not None]
        summary = "-" if not found else (f"{statistics.median(found):g} ({min(found):g}-{max(found):g}), "
                                         f"{len(found)}/{len(per_seed)} seeds")
        print(f"| {backbone} | {layers} | " + " | ".join(columns) + f" | {summary} |")
        if found:
            maxima.setdefault(backbone, []).append((layers, statistics.median(found)))
    if args.plot and len(lrs) > 1:
        fig, ax = plot_logs.new_figure("largest learning rate that trains, against depth", "lr_max", log_y=True)
        ax.set_xscale("log")
        ax.set_xlabel("layers")
        for backbone, points in sorted(maxima.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=backbone)
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_logs.save_figure(fig, ax, args.plot)


if __name__ == "__main__":
    main()
