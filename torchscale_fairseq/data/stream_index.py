"""The JSON index of raw-text shards for the streaming tasks (TorchScale's data format).

``DATA/json/{split}.json`` is a list of corpora::

    [{"source": ["shard/train/00000.txt", ...], "weight": 1.0, "name": "wiki"}, ...]

Paths are relative to ``DATA`` (or absolute). A shard is UTF-8 text, one paragraph per
line, documents separated by blank lines. ``weight`` (default 1.0) is the corpus's share
of training blocks; ``name`` is optional. Every check here raises a one-line
:class:`TsConfigError` naming the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from torchscale_fairseq.errors import TsConfigError

_PROBE_BYTES = 1 << 16


@dataclass(frozen=True)
class Corpus:
    """One entry of the index: its shard paths and sampling weight."""

    name: str
    shards: tuple[str, ...]
    weight: float


def index_path(data: str, split: str) -> Path:
    """``DATA/json/{split}.json``."""
    return Path(data) / "json" / f"{split}.json"


def _check_shard(path: Path, index: Path) -> None:
    """A readable file with some non-blank text."""
    if not path.exists():
        raise TsConfigError(f"shard {path} listed in {index} does not exist")
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(_PROBE_BYTES)
                if not chunk:
                    raise TsConfigError(f"shard {path} listed in {index} is empty (no text)")
                if chunk.strip():
                    return
    except OSError as err:
        raise TsConfigError(f"shard {path} listed in {index} is unreadable: {err.strerror or err}") from err


def _parse_weight(entry: dict, where: str) -> float:
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise TsConfigError(f"{where}: 'weight' must be a finite number, got {weight!r}")
    if weight < 0:
        raise TsConfigError(f"{where}: 'weight' must not be negative, got {weight}")
    return float(weight)


def load_index(data: str, split: str, check_shards: bool = True) -> list[Corpus]:
    """The corpora of ``split``, validated (and their shards checked unless told not to)."""
    path = index_path(data, split)
    if not path.is_file():
        raise TsConfigError(f"stream index {path} does not exist (expected DATA/json/{split}.json)")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise TsConfigError(f"stream index {path} is unreadable: {err}") from err
    except json.JSONDecodeError as err:
        raise TsConfigError(f"stream index {path} is not valid JSON: {err.msg} (line {err.lineno})") from err
    if not isinstance(entries, list) or not entries:
        raise TsConfigError(f"stream index {path} must be a non-empty JSON list of corpora")
    corpora = []
    for i, entry in enumerate(entries):
        where = f"stream index {path}, corpus {i}"
        if not isinstance(entry, dict):
            raise TsConfigError(f"{where}: must be a JSON object with 'source' and 'weight'")
        source = entry.get("source")
        if not isinstance(source, list) or not source or not all(isinstance(s, str) and s for s in source):
            raise TsConfigError(f"{where}: 'source' must be a non-empty list of shard paths")
        shards = tuple(str(Path(data) / s) for s in source)
        corpora.append(Corpus(str(entry.get("name", i)), shards, _parse_weight(entry, where)))
    if sum(c.weight for c in corpora) <= 0:
        raise TsConfigError(f"stream index {path}: the corpus weights must sum to a positive number")
    if check_shards:
        for corpus in corpora:
            for shard in corpus.shards:
                _check_shard(Path(shard), path)
    return corpora
