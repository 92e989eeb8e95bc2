"""Tiny raw-text shards and JSON indexes for the streaming-task tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "café", "naïve", "river", "stone", "cloud", "ember", "zebra", "quartz"]


def make_docs(n_docs: int, seed: int, tag: str = "doc") -> list[list[str]]:
    """``n_docs`` documents of 1-4 lines; the first line starts with a unique ``{tag}{i}``."""
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(1, 4))]
        lines[0] = f"{tag}{i} {lines[0]}"
        docs.append(lines)
    return docs


def write_shard(path: Path, docs: list[list[str]]) -> Path:
    """Documents separated by blank lines (as ``data_prep`` writes them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join("\n".join(doc) for doc in docs) + "\n", encoding="utf-8")
    return path


def write_index(data: Path, split: str, corpora: list[dict]) -> Path:
    """``data/json/{split}.json``."""
    path = data / "json" / f"{split}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(corpora), encoding="utf-8")
    return path


def make_stream_data(data: Path, corpora: dict[str, tuple[int, int, float]], valid_docs: int = 6) -> Path:
    """``corpora``: name -> (shards, documents per shard, weight); plus one valid shard."""
    entries = []
    for c, (name, (n_shards, n_docs, weight)) in enumerate(corpora.items()):
        paths = []
        for s in range(n_shards):
            write_shard(data / "shard" / name / f"{s:05d}.txt", make_docs(n_docs, seed=100 * c + s, tag=f"{name}{s}d"))
            paths.append(f"shard/{name}/{s:05d}.txt")
        entries.append({"source": paths, "source_lang": "en", "weight": weight, "name": name})
    write_index(data, "train", entries)
    write_shard(data / "shard" / "valid" / "00000.txt", make_docs(valid_docs, seed=999, tag="valid"))
    write_index(data, "valid", [{"source": ["shard/valid/00000.txt"], "weight": 1.0}])
    return data
