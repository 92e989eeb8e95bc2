"""``python gc_probe_cli.py ARGS...``: ``fairseq-train ARGS`` with Python's collector set to run at
nearly every allocation, printing ``GC_PROBE inside=N outside=M``: the collections that started
inside fairseq's ``Trainer.train_step`` (which the plugin's trainer calls) and outside it."""

from __future__ import annotations

import gc
import sys

from fairseq import trainer

counts = {"inside": 0, "outside": 0}
depth = [0]
original = trainer.Trainer.train_step


def train_step(self, samples, raise_oom=False):
    depth[0] += 1
    try:
        return original(self, samples, raise_oom)
    finally:
        depth[0] -= 1


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        counts["inside" if depth[0] else "outside"] += 1


def main() -> None:
    trainer.Trainer.train_step = train_step
    gc.callbacks.append(on_gc)
    gc.set_threshold(10, 1, 1)
    sys.argv = ["fairseq-train", *sys.argv[1:]]
    from fairseq_cli import train

    try:
        train.cli_main()
    finally:
        print(f"GC_PROBE inside={counts['inside']} outside={counts['outside']}", flush=True)


if __name__ == "__main__":
    main()
