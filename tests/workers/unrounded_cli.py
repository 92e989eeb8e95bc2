"""``python unrounded_cli.py fairseq-train ARGS...``: the console tool's own ``cli_main``
with fairseq's 3-decimal rounding of logged meters turned off, so tests can compare
per-update losses to 1e-4 relative (the JSON log prints 6 significant digits)."""

from __future__ import annotations

import importlib
import sys

from fairseq.logging import meters

TOOLS = {"fairseq-train": "fairseq_cli.train", "fairseq-generate": "fairseq_cli.generate"}


def unround_meters() -> None:
    """Logged meters keep every digit (fairseq's ``safe_round`` rounds them to 3 decimals)."""
    meters.safe_round = lambda number, ndigits: number.item() if hasattr(number, "item") else number


def main() -> None:
    tool = sys.argv[1]
    unround_meters()
    sys.argv = [tool, *sys.argv[2:]]
    importlib.import_module(TOOLS[tool]).cli_main()


if __name__ == "__main__":
    main()
