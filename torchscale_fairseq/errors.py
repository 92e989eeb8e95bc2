"""User-facing configuration errors: one line naming what is wrong and how to fix it.

An uncaught :class:`TsConfigError` in a console tool, also when fairseq re-raises it
wrapped in its own exception, prints just that line (no traceback) and exits with
status 2; code that calls the plugin from Python gets a normal exception.
"""

from __future__ import annotations

import os
import sys
from typing import Optional


class TsConfigError(ValueError):
    """A bad flag combination, file, checkpoint or data set."""


def config_error_in_chain(exc: Optional[BaseException]) -> Optional[TsConfigError]:
    """The :class:`TsConfigError` that ``exc`` is or was raised from, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, TsConfigError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _excepthook(exc_type, exc, tb, _previous=sys.excepthook):
    error = config_error_in_chain(exc)
    if error is None:
        _previous(exc_type, exc, tb)
        return
    sys.stderr.write(f"{os.path.basename(sys.argv[0]) or 'python'}: error: {error}\n")
    sys.stderr.flush()
    os._exit(2)


def install_excepthook() -> None:
    """Make uncaught :class:`TsConfigError` print one line (idempotent)."""
    if getattr(sys.excepthook, "__name__", "") != "_excepthook":
        sys.excepthook = _excepthook
