"""Which runs of a learning-rate x depth grid train, and the largest learning rate that does (issue 25
item 1, the DeepNet / Magneto stability claim), over runs named
``<prefix>_<backbone>_L<layers>_lr<lr>_s<seed>``.

    python experiments/stability.py /tmp/results-work/runs/stab_*_s[0-9]* --unigram 687 [--plot out.png]
    python experiments/stability.py [RUN_DIR...] --records runs.jsonl --unigram 687   # the runs recorded there too
    python experiments/stability.py RUN_DIR --unigram 687 --outcome     # one run: trains|stalled|diverged

Criteria, fixed before any run: a run **diverged** when it stopped on non-finite values or ended
with a training loss more than 1 bit above its minimum (``summarize.py``); it **stalled** when its
final validation perplexity is not at least 10% below the unigram model's (``--unigram``: a model
there learnt only the token frequencies); it **trains** otherwise. ``lr_max`` of a backbone at a
depth, per seed: the largest learning rate of the grid at which that seed trains (``-`` where none
does). Printed: one row per backbone and depth, one column per learning rate (seeds that train /
seeds run, and the final validation perplexity, mean ± std (min-max)), then ``lr_max`` (median
and min-max over seeds). ``--plot``: ``lr_max`` against depth per backbone (log axes), as the
DeepNet and Magneto papers draw it, once the grid has more than one learning rate. ``--records``: one
line per run (name, diverged, final validation perplexity) kept in a file, so that a report covers
runs made on several machines (docs/results/stability/runs.jsonl).
"""

from __future__ import annotations

import argparse
import json
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


def record(run_dir: Path) -> dict:
    """What the criteria need of one run: its name, whether it diverged, its final validation perplexity."""
    m = metrics(run_dir)
    return {"run": run_dir.name, "diverged": bool(m["diverged"]), "ppl": m["ppl_final"]}


def classify(rec: dict, unigram_ppl: float) -> str:
    """``trains`` | ``stalled`` | ``diverged`` of one run's record, by the criteria above."""
    if rec["diverged"]:
        return "diverged"
    if rec["ppl"] is None or rec["ppl"] >= STALL_MARGIN * unigram_ppl:
        return "stalled"
    return "trains"


def outcome(run_dir: Path, unigram_ppl: float) -> tuple[str, float | None]:
    """(``trains`` | ``stalled`` | ``diverged``, final validation perplexity) of one run."""
    rec = record(run_dir)
    return classify(rec, unigram_ppl), rec["ppl"]


def lr_max(outcomes: dict[float, str]) -> float | None:
    """The largest learning rate whose outcome is ``trains`` (``None``: none)."""
    trained = [lr for lr, o in outcomes.items() if o == "trains"]
    return max(trained) if trained else None


def update_records(path: Path, run_dirs: Sequence[Path]) -> list[dict]:
    """The records in ``path`` (JSON lines), each of ``run_dirs`` added or replacing its own name's, written
    back sorted by name: a report over runs made on several machines, kept in the repository."""
    records = {}
    if path.exists():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                rec = json.loads(line)
                records[rec["run"]] = {key: rec[key] for key in ("run", "diverged", "ppl")}
            except (ValueError, KeyError, TypeError):
                raise SystemExit(f"{path}:{n}: not a run record (one JSON object with 'run', 'diverged', 'ppl' "
                                 "per line); fix or remove that line") from None
    records.update((r.name, record(r)) for r in run_dirs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(records[k]) + "\n" for k in sorted(records)))
    return [records[k] for k in sorted(records)]


def plotted_point(per_seed: list[float | None], lrs: list[float]) -> tuple[float, float, float, str]:
    """(median, min, max, marker) over the seeds' ``lr_max`` at one backbone and depth. A seed that trains at
    no grid rate counts one x2 step below the grid (marker ``v``: "< lowest"); a median at the grid top may
    be higher (``^``: ">= top"); ``o`` otherwise."""
    below = lrs[0] / 2
    values = [below if v is None else v for v in per_seed]
    mid = statistics.median(values)
    return mid, min(values), max(values), "v" if mid == below else "^" if mid == lrs[-1] else "o"


def plot_lr_max(maxima: dict[str, dict[int, list[float | None]]], lrs: list[float], path: Path) -> None:
    """lr_max against depth per backbone (log axes), as the DeepNet and Magneto papers draw it: the median
    over seeds with a min-max bar (``plotted_point``). Backbones are shifted a little along x so that equal
    values stay visible."""
    fig, ax = plot_logs.new_figure("largest learning rate that trains (median, min-max over seeds)", "lr_max",
                                   log_y=True)
    ax.set_xscale("log")
    ax.set_xlabel("layers")
    for i, (backbone, by_depth) in enumerate(sorted(maxima.items())):
        shift = 1.06 ** (i - (len(maxima) - 1) / 2)
        depths = sorted(by_depth)
        points = [plotted_point(by_depth[d], lrs) for d in depths]
        x = [d * shift for d in depths]
        mid = [p[0] for p in points]
        line = ax.plot(x, mid, label=backbone)[0]
        ax.errorbar(x, mid, yerr=[[p[0] - p[1] for p in points], [p[2] - p[0] for p in points]], fmt="none",
                    ecolor=line.get_color(), capsize=3)
        for xi, (m, _, _, marker) in zip(x, points):
            ax.plot(xi, m, marker=marker, color=line.get_color(), markersize=8)
    ax.set_yticks([lrs[0] / 2, *lrs], [f"< {lrs[0]:g}", *(f"{lr:g}" for lr in lrs[:-1]), f">= {lrs[-1]:g}"])
    ax.minorticks_off()
    depths = sorted({d for by_depth in maxima.values() for d in by_depth})
    ax.set_xticks(depths, [str(d) for d in depths])
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_logs.save_figure(fig, ax, path)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories <prefix>_<backbone>_L<layers>_lr<lr>_s<seed>")
    parser.add_argument("--unigram", type=float, required=True, help="the unigram model's validation perplexity")
    parser.add_argument("--plot", type=Path, help="write lr_max against depth (PNG) here")
    parser.add_argument("--outcome", action="store_true", help="print each run's outcome, one per line (no table)")
    parser.add_argument("--records", type=Path, help="JSON-lines file of run records: the runs given are added "
                        "to it (replacing their own earlier records) and the report covers every record in it")
    args = parser.parse_args(argv)
    if args.outcome:
        for run_dir in args.runs:
            print(outcome(run_dir, args.unigram)[0])
        return
    for run_dir in args.runs:
        if RUN_NAME.match(run_dir.name) is None:
            raise SystemExit(f"{run_dir.name}: not named <prefix>_<backbone>_L<layers>_lr<lr>_s<seed>")
    records = update_records(args.records, args.runs) if args.records else [record(r) for r in args.runs]
    if not records:
        raise SystemExit("no runs to report: give run directories, or --records FILE with runs recorded in it")
    # (backbone, layers) -> seed -> lr -> (outcome, ppl)
    grid: dict[tuple[str, int], dict[int, dict[float, tuple[str, float | None]]]] = {}
    for rec in records:
        match = RUN_NAME.match(rec["run"])
        if match is None:
            raise SystemExit(f"{args.records}: record {rec['run']!r} is not named "
                             "<prefix>_<backbone>_L<layers>_lr<lr>_s<seed>; fix or remove that line")
        cell = grid.setdefault((match["backbone"], int(match["layers"])), {})
        cell.setdefault(int(match["seed"]), {})[float(match["lr"])] = (classify(rec, args.unigram), rec["ppl"])
    lrs = sorted({lr for cell in grid.values() for seeds in cell.values() for lr in seeds})
    print(f"trains: final validation ppl < {STALL_MARGIN} x {args.unigram:g} (unigram) = "
          f"{STALL_MARGIN * args.unigram:.1f}, no divergence\n")
    print("| backbone | layers | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | lr_max (median, min-max) |")
    print("|---|---|" + "---|" * len(lrs) + "---|")
    maxima: dict[str, dict[int, list[float | None]]] = {}
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
        maxima.setdefault(backbone, {})[layers] = per_seed
        found = [x for x in per_seed if x is not None]
        summary = "-" if not found else (f"{statistics.median(found):g} ({min(found):g}-{max(found):g}), "
                                         f"{len(found)}/{len(per_seed)} seeds")
        print(f"| {backbone} | {layers} | " + " | ".join(columns) + f" | {summary} |")
    if args.plot and len(lrs) > 1:
        plot_lr_max(maxima, lrs, args.plot)


if __name__ == "__main__":
    main()
