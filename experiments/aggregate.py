"""Mean and spread over seeds of the runs of experiments/run.sh, as a markdown table and plots.

    python experiments/aggregate.py /tmp/results-work/runs/depth_*_s[0-9]*
    python experiments/aggregate.py RUN_DIR... --plot docs/results/depth/valid_ppl.png --metric valid_ppl

Run directories named ``<config>_s<seed>`` are grouped by ``<config>`` (a name without a seed
suffix is its own group). Per group: number of seeds, mean ± sample standard deviation
(min-max) of the final and best validation perplexity, final training loss (base 2), largest
gradient norm, clipped updates, loss spikes, expert / dense gradient-norm ratio, final routing
entropy, BLEU/chrF and the fraction of distinct test hypotheses where present, and how many seeds
diverged (summarize.py's definitions).
``--moe`` adds the MoE routing columns: expert load CV (``moe_cv_<layer>``, mean over the MoE
layers) at the final validation and in the last training interval, and the dropped fraction of
assignments (``moe_drop``) in the last training interval and averaged over the training intervals
(validation never drops: ``--moe-eval-capacity-factor 0``).
``--runs-jsonl FILE`` writes the data behind the table and the prose that quotes single runs (``--merge``: into
the runs FILE already holds, replacing those given again): one
JSON line per run (:func:`run_record`: the table's numbers, with ``--moe`` the MoE ones, every
validation's perplexity, every logged interval's loss, gradient norm and its dense / expert parts,
clipping and learning rate, and the test outputs' counts).
``--plot`` draws, per group, the mean over the seeds that logged each point, with a min-max band,
of ``--metric``: ``valid_ppl``, ``train_loss``, ``gnorm``, ``routing_entropy`` (``moe_entropy``),
``clipping`` (cumulative clipped updates), ``moe_cv`` / ``valid_moe_cv`` (load CV, mean over the
MoE layers, training / validation) or any other key of the training records.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summarize import fmt, metrics  # noqa: E402

from torchscale_fairseq.cli import plot_logs  # noqa: E402

SEED_SUFFIX = re.compile(r"^(?P<config>.+)_s(?P<seed>\d+)$")
COLUMNS = (  # (column, metric key, decimals)
    ("valid ppl final", "ppl_final", 1),
    ("valid ppl best", "ppl_best", 1),
    ("train loss final", "loss_final", 2),
    ("max gnorm", "gnorm_max", 2),
    ("clipped updates", "clipped", 0),
    ("loss spikes", "spikes", 0),
    ("expert / dense norm", "norm_ratio", 3),
    ("routing entropy", "entropy", 3),
    ("BLEU", "bleu", 2),
    ("chrF", "chrf", 2),
    ("distinct hypotheses", "distinct", 3),
)
MOE_COLUMNS = (  # with --moe
    ("load CV valid", "cv_valid", 3),
    ("load CV train", "cv_train", 3),
    ("dropped train final", "drop_train", 4),
    ("dropped train mean", "drop_mean", 4),
)


def _num(value: object) -> float | None:
    """A finite number from a log value (fairseq writes numbers as strings), else ``None``."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def layer_mean(record: dict, prefix: str) -> float | None:
    """Mean over the MoE layers of the ``<prefix><layer>`` values of one log record."""
    values = [_num(v) for k, v in record.items() if k.startswith(prefix)]
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def moe_metrics(run_dir: Path) -> dict[str, float | None]:
    """Final load CV (validation, training) and final training dropped fraction of one run."""
    log = plot_logs.parse_log(run_dir / "train.log")
    valid, train = log.records["valid"], plot_logs.training_records(log)
    drops = [d for d in (_num(r.get("moe_drop")) for r in train) if d is not None]
    return {
        "cv_valid": layer_mean(valid[-1], "valid_moe_cv_") if valid else None,
        "cv_train": layer_mean(train[-1], "moe_cv_") if train else None,
        "drop_train": _num(train[-1].get("moe_drop")) if train else None,
        "drop_mean": statistics.fmean(drops) if drops else None,
    }


def group_runs(run_dirs: Sequence[Path]) -> dict[str, list[Path]]:
    """Run directories by configuration (the name without its ``_s<seed>`` suffix), in first-seen order."""
    groups: dict[str, list[Path]] = {}
    for run_dir in run_dirs:
        match = SEED_SUFFIX.match(run_dir.name)
        groups.setdefault(match["config"] if match else run_dir.name, []).append(run_dir)
    return groups


def spread(values: list[float], places: int) -> str:
    """``mean ± std (min-max)`` of ``values`` (std: sample standard deviation; one value: itself)."""
    if not values:
        return "-"
    if len(values) == 1:
        return fmt(values[0], places)
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return f"{fmt(mean, places)} ± {fmt(std, places)} ({fmt(min(values), places)}-{fmt(max(values), places)})"


def table(groups: dict[str, list[Path]], moe: bool = False) -> list[str]:
    """Markdown lines: one row per configuration; columns no run has are left out."""
    rows = []
    for config, dirs in groups.items():
        ms = [{**metrics(d), **(moe_metrics(d) if moe else {})} for d in dirs]
        row = {"config": config, "seeds": str(len(ms))}
        for column, key, places in COLUMNS + (MOE_COLUMNS if moe else ()):
            row[column] = spread([m[key] for m in ms if m[key] is not None], places)
        row["diverged"] = f"{sum(bool(m['diverged']) for m in ms)}/{len(ms)}"
        rows.append(row)
    keys = [k for k in rows[0] if any(r[k] != "-" for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(r[k] for k in keys) + " |" for r in rows]
    return lines


TRAIN_KEYS = ("loss", "gnorm", "gnorm_dense", "gnorm_expert", "clip", "lr")  # per interval, in --runs-jsonl


def run_record(run_dir: Path, moe: bool = False) -> dict:
    """One run as a line of ``--runs-jsonl``: its name, configuration and seed (``None`` without an
    ``_s<seed>`` suffix), :func:`summarize.metrics` (with ``moe``, :func:`moe_metrics` too), each
    validation's perplexity and each logged interval's :data:`TRAIN_KEYS` by update, and with a
    ``generate_test.txt`` its outputs as ``fairseq-generate`` wrote them (``D-`` lines): how many, how
    many distinct (a count; the table's ``distinct`` is the fraction over ``H-`` lines) and the three
    commonest. A non-finite number is ``null`` (``nonfinite`` says the run had one), so every line is
    strict JSON."""
    log = plot_logs.parse_log(run_dir / "train.log")
    match = SEED_SUFFIX.match(run_dir.name)
    updates, ppl = plot_logs.valid_ppl(log)
    train = []
    for logged in plot_logs.training_records(log):
        update = _num(logged.get("num_updates"))
        if update is not None:
            train.append({"update": int(update), **{k: _num(logged[k]) for k in TRAIN_KEYS if k in logged}})
    numbers = {**metrics(run_dir), **(moe_metrics(run_dir) if moe else {})}
    record = {"run": run_dir.name, "config": match["config"] if match else run_dir.name,
              "seed": int(match["seed"]) if match else None,
              **{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in numbers.items()},
              "valid": [{"update": int(u), "ppl": p} for u, p in zip(updates, ppl)], "train": train}
    generated = run_dir / "generate_test.txt"
    if generated.is_file():
        outputs = Counter(line.split("\t")[-1] for line in generated.read_text(errors="replace").splitlines()
                          if line.startswith("D-"))
        record["test_outputs"] = {"count": outputs.total(), "distinct": len(outputs),
                                  "commonest": outputs.most_common(3)}
    return record


def curve(run: plot_logs.RunLog, metric: str) -> tuple[list[float], list[float]]:
    """(updates, values) of ``metric`` in one run."""
    if metric == "valid_ppl":
        return plot_logs.valid_ppl(run)
    if metric == "clipping":
        return plot_logs.clipped_updates(run)
    if metric in ("moe_cv", "valid_moe_cv"):  # mean over the MoE layers
        records = run.records["valid"] if metric == "valid_moe_cv" else plot_logs.training_records(run)
        updates = "valid_num_updates" if metric == "valid_moe_cv" else "num_updates"
        points = [(_num(r.get(updates)), layer_mean(r, metric + "_")) for r in records]
        points = [(x, y) for x, y in points if x is not None and y is not None]
        return [x for x, _ in points], [y for _, y in points]
    key = {"train_loss": "loss", "routing_entropy": "moe_entropy"}.get(metric, metric)
    return plot_logs.series(plot_logs.training_records(run), key, "num_updates")


def plot(groups: dict[str, list[Path]], metric: str, out: Path, title: str | None = None) -> bool:
    """Mean curve with a min-max band per configuration; False if no run logged ``metric``."""
    fig, ax = plot_logs.new_figure(title or metric.replace("_", " "), metric, log_y=metric == "valid_ppl")
    drawn = False
    for config, dirs in groups.items():
        by_update: dict[float, list[float]] = {}
        for d in dirs:
            for x, y in zip(*curve(plot_logs.parse_log(d / "train.log"), metric)):
                by_update.setdefault(x, []).append(y)
        if not by_update:
            continue
        xs = sorted(by_update)
        ys = [by_update[x] for x in xs]
        (line,) = ax.plot(xs, [statistics.fmean(v) for v in ys], marker="o", markersize=2,
                          label=f"{config} ({len(dirs)} seeds)")
        ax.fill_between(xs, [min(v) for v in ys], [max(v) for v in ys], color=line.get_color(), alpha=0.2)
        drawn = True
    if drawn:
        out.parent.mkdir(parents=True, exist_ok=True)
        plot_logs.save_figure(fig, ax, out)
    return drawn


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: print the table, and draw ``--plot`` if given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each with a train.log)")
    parser.add_argument("--plot", type=Path, help="write a PNG of --metric (mean and min-max band per config)")
    parser.add_argument("--metric", default="valid_ppl", help="valid_ppl, train_loss, gnorm, routing_entropy, "
                        "clipping, moe_cv, valid_moe_cv or a training log key (default valid_ppl)")
    parser.add_argument("--moe", action="store_true", help="add the MoE columns: load CV (validation, "
                        "training) and dropped fraction")
    parser.add_argument("--title", help="plot title (default: the metric)")
    parser.add_argument("--runs-jsonl", type=Path, help="write one JSON line per run: the table's numbers, every "
                        "validation's perplexity and every logged interval (the data behind the table)")
    parser.add_argument("--merge", action="store_true", help="with --runs-jsonl: keep the file's lines of the runs "
                        "not given (runs made on other machines), replacing those of the runs given")
    args = parser.parse_args(argv)
    runs = [d for d in args.runs if (d / "train.log").is_file()]
    for d in sorted(set(args.runs) - set(runs)):
        print(f"skipped {d}: no train.log", file=sys.stderr)
    if not runs:
        sys.exit("error: no run directory with a train.log given")
    groups = group_runs(runs)
    print("\n".join(table(groups, args.moe)))
    if args.runs_jsonl:
        args.runs_jsonl.parent.mkdir(parents=True, exist_ok=True)
        lines = {}
        if args.merge and args.runs_jsonl.is_file():
            lines = {json.loads(line)["run"]: line for line in args.runs_jsonl.read_text().splitlines() if line.strip()}
        for d in runs:
            lines[d.name] = json.dumps(run_record(d, args.moe), allow_nan=False)
        args.runs_jsonl.write_text("".join(line + "\n" for line in lines.values()))
    if args.plot and not plot(groups, args.metric, args.plot, args.title):
        sys.exit(f"error: no run logged {args.metric!r}; nothing drawn")


if __name__ == "__main__":
    main()
