"""``data_utils.batch_by_size`` on 10M sentence lengths: fairseq's own (compiled
``data_utils_fast``, which drops the last batch, fairseq issue #5036) against the function the
plugin installs (the compiled batches plus the dropped tail), and checks that the plugin's
batches are fairseq's with every index kept.

The lengths are drawn once (log-normal, 1..256 tokens, seed 0) and sorted by length as fairseq's
``ordered_indices`` does; each configuration is timed ``--repeats`` times, fairseq's and the
plugin's calls alternating (best and median).

    .venv/bin/python benchmarks/batching.py
    # the plugin of another checkout (e.g. an older commit) instead of this one:
    PYTHONPATH=/path/to/checkout .venv/bin/python benchmarks/batching.py
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, List, Sequence

import numpy as np
from _common import load_average, now
from fairseq.data import data_utils

fairseq_batch_by_size = data_utils.batch_by_size  # captured before the plugin replaces it

import torchscale_fairseq  # noqa: E402  (installs the plugin's batch_by_size)

# (label, max_tokens, max_sentences, required_batch_size_multiple, through num_tokens_fn)
CONFIGS = [
    ("--max-tokens 4096, multiple 8, num_tokens_vec", 4096, None, 8, False),
    ("--batch-size 16, multiple 8, num_tokens_vec", None, 16, 8, False),
    ("--max-tokens 4096, multiple 8, num_tokens_fn", 4096, None, 8, True),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=10_000_003, help="number of sentence lengths")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def interleaved_times(impls: Sequence[Callable[..., List[np.ndarray]]], repeats: int, *args, **kwargs):
    """Seconds of ``impl(*args, **kwargs)`` per impl and repeat, the impls alternating; each result
    is freed before the next call (so a call never pays the garbage collector for another's batches)."""
    times = [[] for _ in impls]
    for _ in range(repeats):
        for impl, impl_times in zip(impls, times):
            gc.collect()
            start = time.perf_counter()
            impl(*args, **kwargs)
            impl_times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> None:
    args = parse_args(argv)
    rng = np.random.RandomState(0)
    lengths = np.clip(rng.lognormal(3.0, 0.8, size=args.sentences).astype(np.int64), 1, 256)
    indices = np.argsort(lengths, kind="mergesort").astype(np.int64)
    sorted_lengths = lengths[indices]
    print(f"# {now()}; load {load_average()}; {args.sentences} sentences (mean length {lengths.mean():.1f}); "
          f"plugin from {torchscale_fairseq.__file__}")
    print("| configuration | fairseq best / median s | plugin best / median s | plugin / fairseq (best) "
          "| batches fairseq / plugin "
          "| indices the plugin drops | plugin = fairseq's batches + the dropped one |")
    print("|---|---|---|---|---|---|---|")
    for label, max_tokens, max_sentences, mult, through_fn in CONFIGS:
        kwargs = dict(max_tokens=max_tokens, max_sentences=max_sentences, required_batch_size_multiple=mult,
                      num_tokens_fn=lengths.__getitem__ if through_fn else None,
                      num_tokens_vec=None if through_fn else sorted_lengths)
        stock_times, ours_times = interleaved_times([fairseq_batch_by_size, data_utils.batch_by_size], args.repeats,
                                                    indices, **kwargs)
        stock_best, stock_med = min(stock_times), statistics.median(stock_times)
        ours_best, ours_med = min(ours_times), statistics.median(ours_times)
        stock, ours = fairseq_batch_by_size(indices, **kwargs), data_utils.batch_by_size(indices, **kwargs)
        kept = sum(map(len, ours))
        tail = indices[sum(map(len, stock)):]
        expected = stock + ([tail] if len(tail) else [])
        same = len(ours) == len(expected) and all(np.array_equal(a, b) for a, b in zip(expected, ours))
        print(f"| {label} | {stock_best:.3f} / {stock_med:.3f} | {ours_best:.3f} / {ours_med:.3f} | "
              f"{ours_best / stock_best:.2f} | {len(stock)} / {len(ours)} | {len(indices) - kept} "
              f"| {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
