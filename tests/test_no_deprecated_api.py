"""The plugin calls no API its installed libraries deprecate: models of every kind (X-MoE
included) build and train a step, and the sequence-parallel collectives run, with every
``DeprecationWarning`` and ``FutureWarning`` raised as an error (only the plugin's code and torch
run there; fairseq's import-time warnings are past). A filter by module would not do: torch's
deprecated collectives warn from their logging wrapper, not from the caller. On the newest torch
this catches, e.g., the ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` that torch 2.13
deprecates (:mod:`torchscale_fairseq.model_parallel.collectives` takes the new names where they
exist)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.helpers import model_utils
from tests.helpers.rendezvous import rendezvous_url
from torchscale_fairseq.model_parallel.collectives import all_gather_into, reduce_scatter_into


@contextlib.contextmanager
def deprecations_from_the_plugin_raise() -> Iterator[None]:
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.simplefilter("error", category=category)
        yield


@pytest.mark.parametrize("kind,extra", [("lm", {"moe_expert_count": 4, "moe_freq": 1}), ("mt", {}), ("mlm", {})])
def test_a_training_step_calls_nothing_deprecated(kind, extra):
    torch.manual_seed(0)
    with deprecations_from_the_plugin_raise():
        model = model_utils.build(kind, **extra)
        model.train()
        tokens = torch.randint(4, 40, (2, 12))
        lengths = torch.full((2,), 12)
        out = {"lm": lambda: model(tokens), "mlm": lambda: model(tokens),
               "mt": lambda: model(tokens, lengths, tokens)}[kind]()
        out[0].float().logsumexp(-1).mean().backward()
    assert any(p.grad is not None for p in model.parameters())


def test_sequence_parallel_collectives_use_the_current_names(tmp_path):
    """One gloo rank: gather and reduce-scatter give their input back, and warn of nothing."""
    dist.init_process_group("gloo", init_method=rendezvous_url(tmp_path), rank=0, world_size=1)
    try:
        with deprecations_from_the_plugin_raise():
            x = torch.randn(6, 3)
            gathered, scattered = torch.empty(6, 3), torch.empty(6, 3)
            all_gather_into(gathered, x, dist.group.WORLD)
            reduce_scatter_into(scattered, x, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert torch.equal(gathered, x) and torch.equal(scattered, x)
