"""User-facing configuration errors: one line naming what is wrong and how to fix it.

An uncaught :class:`TsConfigError` in a console tool, also when fairseq re-raises it
wrapped in its own exception, prints just that line (no traceback) and exits with
status 2; code that calls the plugin from Python gets a normal exception.
"""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
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


def _fairseq_input_error(exc: Optional[BaseException]) -> Optional[str]:
    """fairseq's own input errors that already say what to do: missing data (``Dataset not
    found``, a missing ``dict.txt``), any other missing file, and samples longer than the
    model's positions."""
    if isinstance(exc, FileNotFoundError):
        what = f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc)
        name = os.path.basename(str(exc.filename or ""))
        if "Dataset not found" in str(exc) or (name.startswith("dict.") and name.endswith(".txt")):
            return f"{what}; check the data directory, or create it with fairseq-preprocess (or data_prep/)"
        return f"{what}; check that the path exists"
    if type(exc) is Exception and "--skip-invalid-size-inputs-valid-test" in str(exc):
        return str(exc).splitlines()[0]
    return None


def one_line(error: BaseException | str) -> str:
    """The message of ``error``; for one re-raised from a DataLoader worker (``Caught ... in
    DataLoader worker``, then the worker's traceback) the original message."""
    text = str(error)
    if "Original Traceback" in text:
        last = text.strip().splitlines()[-1]
        return last.split(": ", 1)[1] if "Error: " in last else last
    return text


def _excepthook(exc_type, exc, tb, _previous=sys.excepthook):
    error = config_error_in_chain(exc) or _fairseq_input_error(exc)
    if error is None:
        _previous(exc_type, exc, tb)
        return
    # the process's own stderr: torch.distributed's excepthook swaps sys.stderr for a
    # buffer it prints only after the previous hook returns, and this one never does
    stream = sys.__stderr__ or sys.stderr
    stream.write(f"{os.path.basename(sys.argv[0]) or 'python'}: error: {one_line(error)}\n")
    stream.flush()
    _remove_multiprocessing_tempdir()
    os._exit(2)


def _remove_multiprocessing_tempdir() -> None:
    """What a normal exit's multiprocessing finaliser does and ``os._exit`` skips: remove this process's
    multiprocessing temporary directory (``$TMPDIR/pymp-*``, the DataLoader workers' sockets), if it made one."""
    tempdir = multiprocessing.process.current_process()._config.get("tempdir")
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)


def install_excepthook() -> None:
    """Make uncaught :class:`TsConfigError` print one line (idempotent)."""
    if getattr(sys.excepthook, "__name__", "") != "_excepthook":
        sys.excepthook = _excepthook
