"""An exit-time abort of fairseq's batch prefetch thread ("terminate called without an active
exception", SIGABRT after training finished).

``fairseq.data.iterators.BufferedIterator`` (``--data-buffer-size``, default 10) collates batches
in a daemon thread, ``BackgroundConsumer``. A run that stops inside an epoch (``--max-update``)
leaves that thread collating while the main thread returns. CPython 3.8-3.13 ends a daemon
thread that takes the GIL back during interpreter finalisation with ``pthread_exit``
(bpo-42969); inside a torch operator the forced unwind reaches pybind11's ``noexcept``
``gil_scoped_release`` destructor and the C++ runtime calls ``std::terminate``. Applies to
fairseq 0.12.2 and ``fairseq-fixed`` 0.12.3.1 (same file), on every torch we support.

We replace ``BackgroundConsumer`` by a subclass that returns after its current batch once a
stop event is set (a ``put`` on a full queue waits in short slices and checks it), and register
an ``atexit`` hook (atexit runs before finalisation, while daemon threads still run normally)
that sets the event of every live consumer and joins it; after :data:`EXIT_JOIN_SECONDS` in all
(a hung DataLoader worker, say) it gives up and stock behaviour applies.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref

import torch
from fairseq.data import iterators

EXIT_JOIN_SECONDS = 30.0
_POLL_SECONDS = 0.05

_live_consumers: weakref.WeakSet[StoppableBackgroundConsumer] = weakref.WeakSet()


class StoppableBackgroundConsumer(iterators.BackgroundConsumer):
    """fairseq's prefetch thread, which returns after its current batch once :attr:`stop` is set."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stop = threading.Event()
        _live_consumers.add(self)

    def run(self) -> None:
        if self.cuda_device is not None:  # as fairseq: no GPU 0 context from pin_memory
            torch.cuda.set_device(self.cuda_device)
        try:
            for item in self._source:
                if not self._put(item):
                    return
                self.count += 1
                if self._max_len is not None and self.count >= self._max_len:
                    break
            self._put(iterators._sentinel)
        except Exception as error:  # handed to the reader, as fairseq does
            self._put(error)

    def _put(self, item: object) -> bool:
        """Queue ``item`` for the reader, waiting for room; ``False`` once stopped."""
        while not self.stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False


def stop_prefetch_threads(timeout: float = EXIT_JOIN_SECONDS) -> None:
    """Stop every live prefetch thread and wait for it, at most ``timeout`` seconds in all."""
    consumers = [c for c in list(_live_consumers) if c.is_alive()]
    for consumer in consumers:
        consumer.stop.set()
    deadline = time.monotonic() + timeout
    for consumer in consumers:
        consumer.join(max(0.0, deadline - time.monotonic()))


def patch_prefetch_thread_exit() -> None:
    iterators.BackgroundConsumer = StoppableBackgroundConsumer
    atexit.register(stop_prefetch_threads)
