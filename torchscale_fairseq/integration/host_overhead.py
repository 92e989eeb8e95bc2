"""What keeps the host from idling the device during a training step: no garbage-collector pause
inside the step, and a per-step logging output reduced only when read."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Mapping
from typing import Any


@contextlib.contextmanager
def no_gc_pause() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (as nanochat's training loop): a
    collection triggered by the allocations of a step would pause it, idling the device; it runs
    at the first allocation after the step instead, while the device works through the step."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class LazyLoggingOutput(Mapping):
    """fairseq's per-step logging output (``agg.get_smoothed_values()`` plus ``sample_size``, less
    ``ppl``, ``wps``, ``wpb`` and ``bsz``), computed on first read: each value is a host sync."""

    def __init__(self, agg: Any, sample_size: Any) -> None:
        self._agg, self._sample_size, self._values = agg, sample_size, None

    def _read(self) -> dict:
        if self._values is None:
            values = dict(self._agg.get_smoothed_values())
            for key in ("ppl", "wps", "wpb", "bsz"):
                values.pop(key, None)
            values["sample_size"] = self._sample_size
            self._values = values
        return self._values

    def __getitem__(self, key: str) -> Any:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())
