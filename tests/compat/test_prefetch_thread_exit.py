"""fairseq's batch prefetch thread at exit (``compat/prefetch_thread_exit.py``): a process that
stops reading a ``BufferedIterator`` while its thread still runs torch operators exits 0, and
no prefetch thread is alive once the atexit hooks have run (stock fairseq: SIGABRT,
"terminate called without an active exception", bpo-42969); a reader that reads to the end
still gets every batch, then the end of the data."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.cli_utils import cli_env

# The observer's atexit hook is registered before the plugin's, so it runs after it.
STOPPED_READER = r"""
import atexit, json, threading
import torch
from fairseq.data import iterators

def observe():
    alive = [t.name for t in threading.enumerate() if isinstance(t, iterators.BackgroundConsumer) and t.is_alive()]
    print(json.dumps({"alive": alive}), flush=True)

atexit.register(observe)
import torchscale_fairseq  # noqa: F401  (installs the fix)

def batches():
    a = torch.randn(384, 384)
    while True:
        for _ in range(20):
            a = torch.tanh(a @ a)
        yield a

reader = iterators.BufferedIterator(4, iterators.CountingIterator(batches(), total=10**9))
for _ in range(2):
    next(reader)
print("stopped reading", flush=True)
"""

FULL_READER = r"""
import json
from fairseq.data import iterators
import torchscale_fairseq  # noqa: F401

items = list(iterators.BufferedIterator(3, iterators.CountingIterator(iter(range(50)), total=50)))
print(json.dumps({"items": items, "patched": iterators.BackgroundConsumer.__module__}))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=300)


def test_reader_that_stops_early_exits_cleanly():
    proc = _run(STOPPED_READER)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "stopped reading" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"alive": []}


def test_reader_still_gets_every_batch_then_the_end():
    proc = _run(FULL_READER)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["items"] == list(range(50))
    assert seen["patched"] == "torchscale_fairseq.compat.prefetch_thread_exit"
