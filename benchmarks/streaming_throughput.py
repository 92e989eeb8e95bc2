"""``streaming_lm`` loader throughput (tokens/s with ``--num-workers`` readers) against the rate at
which ``ts_lm_base`` consumes tokens in training on this machine.

The corpus is the gensim Wikipedia excerpt (cleaned by ``data_prep.wiki_text``) written as raw
text shards; the loader tokenizes it on the fly with the GPT-2 BPE. The model side is a real
fairseq ``Trainer`` on ``ts_lm_base`` fed by the same stream iterator; the time each update
waits for its batch is the loader's cost inside an update.

    .venv/bin/python benchmarks/streaming_throughput.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import REPO, USER_DIR, load_average, now

sys.path.insert(0, str(REPO))

from data_prep.wiki_text import find_gensim_wiki_dump, wiki_documents  # noqa: E402

TARGET = 5.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="loader readers (--num-workers)")
    p.add_argument("--tokens-per-sample", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--loader-batches", type=int, default=200, help="batches timed for the loader alone")
    p.add_argument("--updates", type=int, default=3, help="timed ts_lm_base updates (after one warm-up)")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="torch threads for the model")
    return p.parse_args(argv)


def write_shards(data: Path, n_shards: int) -> int:
    """The Wikipedia excerpt as ``n_shards`` raw text shards plus a JSON index; returns the byte count."""
    docs = wiki_documents(find_gensim_wiki_dump())
    paths, size = [], 0
    for s in range(n_shards):
        text = "\n\n".join("\n".join(doc) for doc in docs[s::n_shards]) + "\n"
        path = data / "shard" / f"{s:05d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        paths.append(f"shard/{s:05d}.txt")
        size += len(text.encode("utf-8"))
    (data / "json").mkdir()
    for split, sources in (("train", paths), ("valid", paths[-1:])):
        (data / "json" / f"{split}.json").write_text(json.dumps([{"source": sources}]))
    return size


def build(data: Path, args: argparse.Namespace):
    """The fairseq config, task and trainer of ``ts_lm_base`` on the stream."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    import torchscale_fairseq  # noqa: F401

    argv = [str(data), "--user-dir", str(USER_DIR), "--task", "streaming_lm", "--arch", "ts_lm_base",
            "--tokens-per-sample", str(args.tokens_per_sample), "--batch-size", str(args.batch_size),
            "--num-workers", str(args.workers), "--optimizer", "adam", "--lr", "5e-4", "--cpu",
            "--share-decoder-input-output-embed", "--batches-per-epoch", "100000", "--seed", "1"]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    model = task.build_model(cfg.model)
    return cfg, task, Trainer(cfg, task, model, task.build_criterion(cfg.criterion))


def loader_rate(task, args: argparse.Namespace) -> float:
    """Tokens/s of the stream alone (first batch, i.e. worker start-up, excluded)."""
    itr = task.get_batch_iterator(task.dataset("train"), max_sentences=args.batch_size, num_workers=args.workers)
    epoch = itr.next_epoch_itr()
    next(epoch)
    start = time.perf_counter()
    for _ in range(args.loader_batches):
        next(epoch)
    elapsed = time.perf_counter() - start
    itr.close()
    return args.loader_batches * args.batch_size * args.tokens_per_sample / elapsed


def model_rate(trainer, args: argparse.Namespace) -> tuple[float, float]:
    """Median update time (s) of ``ts_lm_base`` and median wait for the next batch (s)."""
    epoch = trainer.get_train_iterator(epoch=1).next_epoch_itr()
    trainer.train_step([next(epoch)])
    updates, waits = [], []
    for _ in range(args.updates):
        t0 = time.perf_counter()
        sample = next(epoch)
        t1 = time.perf_counter()
        trainer.train_step([sample])
        updates.append(time.perf_counter() - t0)
        waits.append(t1 - t0)
    return statistics.median(updates), statistics.median(waits)


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="streaming_bench-") as tmp:
        data = Path(tmp)
        size = write_shards(data, args.shards)
        _, task, trainer = build(data, args)
        rate = loader_rate(task, args)
        torch.set_num_threads(args.threads)
        update_s, wait_s = model_rate(trainer, args)
    tokens = args.batch_size * args.tokens_per_sample
    consume = tokens / update_s
    print(f"# {now()} | load {load_average()} | corpus {size / 1e6:.1f} MB in {args.shards} shards | "
          f"workers {args.workers} | batch {args.batch_size}x{args.tokens_per_sample} | torch threads {args.threads}")
    print("| measure | value |")
    print("|---|---|")
    print(f"| loader alone ({args.workers} workers), tokens/s | {rate:,.0f} |")
    print(f"| ts_lm_base update (median of {args.updates}), s | {update_s:.2f} |")
    print(f"| ts_lm_base consumption, tokens/s | {consume:,.0f} |")
    print(f"| ratio loader / consumption | {rate / consume:.1f} (target >= {TARGET:g}) |")
    print(f"| wait for the next batch inside an update (median), ms | {wait_s * 1e3:.2f} "
          f"({100 * wait_s / update_s:.3f}% of the update) |")


if __name__ == "__main__":
    main()
