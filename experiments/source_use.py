"""Does a translation model read its source? (docs/results.md section 12, issue 25 item 2)

    python experiments/source_use.py RUN_DIR_OR_CHECKPOINT... --data DATA [--subset valid] [--max-verses N]
        [--shuffle-seed 0] [--init] [--plot spread.png] [--records rows.jsonl]

Per checkpoint (a run directory stands for its ``checkpoint_last.pt``), on the first ``--max-verses`` pairs of
the split (all by default), in eval mode:

- ``ppl``: the targets' perplexity given their own sources, ``exp(sum of token NLL / target tokens)`` (the
  ``ppl`` fairseq-validate prints, without label smoothing);
- ``ppl shuffled``: the same targets given the sources permuted by ``random.Random(SEED).shuffle``. A model
  that ignores its source scores both the same; one that reads it scores the shuffled pairs worse;
- ``spread``: the encoder output's standard deviation over every non-pad source token of those verses,
  per channel, averaged over the channels. 0 = the encoder maps every input to one vector (it has
  collapsed: nothing in it depends on the source);
- ``--init``: the spread of a model built from the run's configuration with its seed, before training.

Prints one markdown row per checkpoint (name, update, ppl, ppl shuffled, their ratio, spread [at init]).
``--records``: the same rows appended to a JSON-lines file, each with the run's backbone, seed and peak learning
rate and the number of verses measured (``experiments/source_use_summary.py`` reads them).
``--plot``: the spread against the update, one line per training, for checkpoints saved along it (runs
named ``..._u<budget>_s<seed>`` that differ only in the budget are one training: the schedule does not depend on it).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from fairseq import checkpoint_utils, utils

import torchscale_fairseq  # noqa: F401  (registers the plugin)


def checkpoint_path(path: Path) -> Path:
    """A checkpoint file, or the ``checkpoint_last.pt`` of a run directory."""
    ckpt = path / "checkpoint_last.pt" if path.is_dir() else path
    if not ckpt.is_file():
        raise SystemExit(f"source_use.py: no checkpoint at {ckpt}; give a run directory holding checkpoint_last.pt "
                         "or a checkpoint file")
    return ckpt


def pair_batches(dataset, sources: Sequence[int], batch_size: int = 64):
    """Collated batches of the dataset's pairs ``i``, each target ``i`` given source ``sources[i]``."""
    for start in range(0, len(sources), batch_size):
        samples = [{"id": i, "source": dataset[sources[i]]["source"], "target": dataset[i]["target"]}
                   for i in range(start, min(start + batch_size, len(sources)))]
        yield dataset.collater(samples)


@torch.no_grad()
def perplexity(model: torch.nn.Module, dataset, sources: Sequence[int], pad: int) -> float:
    """``exp`` of the mean token NLL of targets ``0..len(sources)-1`` given sources ``sources``."""
    nll, tokens = 0.0, 0
    for batch in pair_batches(dataset, sources):
        lprobs = model.get_normalized_probs(model(**batch["net_input"]), log_probs=True).float()
        target = batch["target"]
        token_nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        keep = target.ne(pad)
        nll += float(token_nll[keep].sum())
        tokens += int(keep.sum())
    return math.exp(nll / tokens)


@torch.no_grad()
def encoder_spread(model: torch.nn.Module, dataset, count: int) -> float:
    """Std over all non-pad source tokens of the first ``count`` verses, per channel, averaged over channels."""
    vectors = []
    for batch in pair_batches(dataset, range(count)):
        net_input = batch["net_input"]
        out = model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
        states = out["encoder_out"][0]  # B x T x C (batch first, as TorchScale's encoder)
        vectors.append(states[~out["encoder_padding_mask"][0]].float())
    return float(torch.cat(vectors).std(0, unbiased=False).mean())


def measure(path: Path, data: str | None, subset: str, max_verses: int | None, shuffle_seed: int,
            init: bool) -> dict:
    """The row of one checkpoint: its run, update, ppl, shuffled ppl and encoder spread (at init)."""
    ckpt = checkpoint_path(path)
    overrides = {"data": data} if data else {}
    state = checkpoint_utils.load_checkpoint_to_cpu(str(ckpt), arg_overrides=overrides)
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(ckpt)], arg_overrides=overrides, state=state)
    model = models[0].eval()
    task.load_dataset(subset)
    dataset = task.dataset(subset)
    count = min(len(dataset), max_verses or len(dataset))
    shuffled = list(range(count))
    random.Random(shuffle_seed).shuffle(shuffled)
    row = {
        "run": ckpt.parent.name, "checkpoint": ckpt.name, "backbone": cfg.model.backbone, "seed": cfg.common.seed,
        "lr": cfg.optimization.lr[0], "update": state["optimizer_history"][-1]["num_updates"], "verses": count,
        "ppl": perplexity(model, dataset, range(count), task.target_dictionary.pad()),
        "ppl_shuffled": perplexity(model, dataset, shuffled, task.target_dictionary.pad()),
        "spread": encoder_spread(model, dataset, count),
    }
    if init:
        utils.set_torch_seed(cfg.common.seed)
        row["spread_init"] = encoder_spread(task.build_model(cfg.model).eval(), dataset, count)
    return row


def plot_spread(rows: Sequence[dict], out: Path) -> None:
    """The encoder spread against the update (0: at init, with ``--init``), one line per training (log y: a
    collapse falls by decades)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lines: dict[str, dict[int, float]] = {}  # runs of one training at several budgets (_u600, _u50) are one line
    for r in rows:
        points = lines.setdefault(re.sub(r"_u\d+_s", " s", r["run"]), {})
        points[r["update"]] = r["spread"]
        if "spread_init" in r:
            points[0] = r["spread_init"]
    for label, points in lines.items():
        ax.plot(*zip(*sorted(points.items())), marker="o", markersize=3, label=label)
    ax.set(xlabel="update", ylabel="encoder output std over tokens", yscale="log",
           title="encoder spread during training (0 = one vector for every source)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def natural_order(path: Path) -> tuple:
    """Sort key: by directory, then by name with its numbers compared as numbers (checkpoint_1_50 < _1_100)."""
    return str(path.parent), [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", type=Path, help="run directories (their checkpoint_last.pt) or checkpoint files")
    p.add_argument("--data", help="the binarised data (default: the one the checkpoint was trained on)")
    p.add_argument("--subset", default="valid")
    p.add_argument("--max-verses", type=int, help="only the first N pairs of the split (default: all)")
    p.add_argument("--shuffle-seed", type=int, default=0)
    p.add_argument("--init", action="store_true", help="also the encoder spread of the run's model at initialisation")
    p.add_argument("--plot", type=Path, help="the spread against the update, one line per run")
    p.add_argument("--records", type=Path, help="append each row to this JSON-lines file")
    args = p.parse_args(argv)
    if args.max_verses is not None and args.max_verses < 2:
        p.error(f"--max-verses must be at least 2 (a spread and a shuffle need two verses), got {args.max_verses}")
    rows = []
    print("| run | checkpoint | update | ppl | ppl shuffled | shuffled / real | encoder spread |"
          + (" spread at init |" if args.init else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if args.init else ""))
    for path in sorted(args.paths, key=natural_order):
        row = measure(path, args.data, args.subset, args.max_verses, args.shuffle_seed, args.init)
        rows.append(row)
        if args.records:
            with args.records.open("a") as f:
                f.write(json.dumps(row) + "\n")
        print(f"| {row['run']} | {row['checkpoint']} | {row['update']} | {row['ppl']:.2f} | {row['ppl_shuffled']:.2f} | "
              f"{row['ppl_shuffled'] / row['ppl']:.3f} | {row['spread']:.5f} |"
              + (f" {row['spread_init']:.5f} |" if args.init else ""), flush=True)
    if args.plot:
        plot_spread(rows, args.plot)


if __name__ == "__main__":
    sys.exit(main())
