"""Documents of raw-text shards, read from a byte offset (for exact resume mid-shard).

A document is a run of non-blank lines; blank lines separate documents. Lines are
decoded as UTF-8; undecodable bytes are dropped and counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple


class RawDocument(NamedTuple):
    """A document's byte offset in its shard and its lines (without line ends)."""

    offset: int
    lines: list[str]


def decode_line(raw: bytes) -> tuple[str, int]:
    """The UTF-8 text of ``raw`` and the number of undecodable bytes dropped from it."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="ignore")
        return text, len(raw) - len(text.encode("utf-8"))


class ShardReader:
    """Iterates the documents of one shard from ``offset``; counts dropped bytes in ``bad_bytes``."""

    def __init__(self, path: str, offset: int = 0) -> None:
        self.path = path
        self.offset = offset
        self.bad_bytes = 0

    def __iter__(self) -> Iterator[RawDocument]:
        pos = self.offset
        start, lines = pos, []
        with open(self.path, "rb") as f:
            f.seek(pos)
            for raw in f:
                text, bad = decode_line(raw)
                self.bad_bytes += bad
                if text.strip():
                    if not lines:
                        start = pos
                    lines.append(text.rstrip("\r\n"))
                elif lines:
                    yield RawDocument(start, lines)
                    lines = []
                pos += len(raw)
        if lines:
            yield RawDocument(start, lines)
