"""User-facing configuration errors: one line naming what is wrong and how to fix it.

An uncaught :class:`TsConfigError` in a console tool prints just that line (no traceback)
and exits with status 2; code that calls the plugin from Python gets a normal exception.
"""

from __future__ import annotations

import os
import sys


class TsConfigError(ValueError):
    """A bad flag combination, file, checkpoint or data set."""


def _excepthook(exc_type, exc, tb, _previous=sys.excepthook):
    if issubclass(exc_type, TsConfigError):
        sys.stderr.write(f"{os.path.basename(sys.argv[0]) or 'python'}: error: {exc}\n")
        sys.stderr.flush()
        os._exit(2)
    _previous(exc_type, exc, tb)


def install_excepthook() -> None:
    """Make uncaught :class:`TsConfigError` print one line (idempotent)."""
    if getattr(sys.excepthook, "__name__", "") != "_excepthook":
        sys.excepthook = _excepthook

