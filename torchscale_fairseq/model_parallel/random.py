"""Dropout RNG for tensor parallelism (Megatron-LM section 3).

Outside the parallel regions (residual dropout) all tensor-parallel ranks use the
default generator, seeded identically, so they drop the same elements. Inside them
(attention dropout on a rank's own heads) :func:`get_rng_tracker().fork()` switches to
a per-rank stream seeded with ``seed + 2718 + tp_rank``. The tracker's state goes into
checkpoints. At tensor-parallel size 1 there is no per-rank stream and ``fork`` changes
nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_SEED_OFFSET = 2718


def _get_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RNGStatesTracker:
    """Named generator states that can be swapped in for a block of code."""

    def __init__(self) -> None:
        self.states: dict[str, dict[str, torch.Tensor]] = {}

    def reset(self) -> None:
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        saved = _get_state()
        torch.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states:
            yield
            return
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: {d: t.clone() for d, t in v.items()} for k, v in self.states.items()}

    def load_state_dict(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        self.states = {k: dict(v) for k, v in states.items()}


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def checkpoint_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` of ``torch.utils.checkpoint`` (non-reentrant): the recomputation in
    backward replays the tracker's streams from where the forward pass found them, so
    dropout inside the parallel regions draws the same mask twice (as Megatron-LM's
    checkpointing does; torch restores only the default generator)."""
    snapshot = _TRACKER.state_dict()

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        current = _TRACKER.state_dict()
        _TRACKER.load_state_dict(snapshot)
        try:
            yield
        finally:
            _TRACKER.load_state_dict(current)

    return contextlib.nullcontext(), replay()


def model_parallel_seed(seed: int, tp_rank: int, tp_size: int) -> None:
    """Seed the per-rank stream used inside the tensor-parallel regions (none at size 1)."""
    _TRACKER.reset()
    if tp_size > 1:
        _TRACKER.add(MODEL_PARALLEL_RNG, seed + _SEED_OFFSET + tp_rank)
