"""``--moe-compiled-experts on``: the fused path's :meth:`~GroupedExperts.combine` (the gather, grouped
GEMMs, biases, activation, Sub-LN and weighted combine) through ``torch.compile`` as one graph, against the
same layer combining eagerly (the reference path): the same outputs, gradients and Adam updates to float
rounding (``aot_eager``: dynamo and AOTAutograd trace it as inductor does), the same with inductor's own
kernels, one graph with no break shared by the layers, and the eager path where the graph would not pay
or cannot replay a first run's random draws."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from tests.helpers.moe_adam_steps import adam_steps
from tests.helpers.moe_compile_counting import counted_moe_compiles
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe import layer as moe_layer
from torchscale_fairseq.modules.moe.config import MoEConfig, moe_config_from_args
from torchscale_fairseq.modules.moe.experts import GroupedExperts
from torchscale_fairseq.modules.moe.layer import MoELayer, RecomputeMemo


@pytest.fixture(autouse=True)
def counted_backend(monkeypatch):
    """The compiled combine on a counted ``aot_eager`` (:func:`counted_moe_compiles`)."""
    with counted_moe_compiles(monkeypatch) as backend:
        yield backend


def _layer(subln: bool = True, dropout: float = 0.0, seed: int = 0) -> MoELayer:
    """Top-2 of 8 experts on the fused path, in bf16 (the grouped GEMMs' type, also in a traced graph),
    capacity factor 1 (some tokens dropped)."""
    torch.manual_seed(seed)
    cfg = MoEConfig(expert_count=8, top_k=2, capacity_factor=1.0, second_expert_policy="all")
    layer = MoELayer(cfg, FFNSpec(16, 24, subln=subln, activation_dropout=dropout)).to(torch.bfloat16)
    layer.experts.grouped_mm = True
    return layer


def _batch(tokens: int = 20, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, tokens, 16, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    padding = torch.zeros(3, tokens, dtype=torch.bool)
    padding[1, tokens * 2 // 3:] = True
    return x, padding


def _train(layer: MoELayer, compiled: bool, steps: int = 2) -> list[torch.Tensor]:
    """What :func:`adam_steps` records of ``steps`` Adam updates, then a validation forward's output."""
    layer.compiled_experts = compiled
    layer.train()
    x, padding = _batch()
    weight = torch.randn(16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    seen = adam_steps(layer, x, padding, weight, steps)
    layer.eval()
    with torch.no_grad():
        seen.append(layer(x, padding)[0])
    return seen


def _assert_close(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):  # to the rounding of each tensor's type (decompositions round)
        rtol, atol = (1e-2, 1e-3) if a.dtype == torch.bfloat16 else (1e-5, 1e-6)
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=rtol, atol=atol), \
            f"tensor {i}: {(a.double() - b.double()).abs().max()}"


@pytest.mark.parametrize("subln", [True, False], ids=["subln", "no-subln"])
def test_compiled_experts_train_as_the_eager_experts(subln, counted_backend):
    eager = _layer(subln)
    compiled = copy.deepcopy(eager)
    expected = _train(eager, False)
    assert counted_backend.calls == 0
    got = _train(compiled, True)
    # the combine ran compiled at every step and in validation: a graph for training, one for validation
    assert (counted_backend.frames, counted_backend.calls) == (2, 3)
    _assert_close(expected, got)


def test_compiled_experts_with_compiled_routing_train_as_the_eager_layer(counted_backend):
    """Both flags: two graphs per mode (the routing's and the combine's), the eager layer's updates."""
    eager = _layer()
    compiled = copy.deepcopy(eager)
    compiled.compiled_routing = True
    expected = _train(eager, False)
    got = _train(compiled, True)
    assert (counted_backend.frames, counted_backend.calls) == (4, 6)
    _assert_close(expected, got)


def test_inductor_kernels_combine_as_the_eager_experts(monkeypatch):
    """Inductor's generated kernels (C++ on the CPU, Triton on a GPU; tests/gpu checks those): the same
    outputs, gradients and updates within bf16 rounding, each tensor to 2% of its norm (bf16 keeps 8 bits)."""
    inductor = CompileCounterWithBackend("inductor")
    monkeypatch.setattr(moe_layer, "COMPILE_BACKEND", inductor)
    eager = _layer()
    compiled = copy.deepcopy(eager)
    expected, got = _train(eager, False, steps=1), _train(compiled, True, steps=1)
    assert inductor.frame_count == 2  # training and validation
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):  # inductor rounds to bf16 once per fused kernel, eager per op
        a, b = a.double(), b.double()
        assert (a - b).norm() <= 2e-2 * a.norm() + 1e-6, f"tensor {i}: {(a - b).norm() / a.norm()}"


def test_activation_dropout_drops_in_the_compiled_graph(monkeypatch):
    """With activation dropout inductor draws its own masks: the compiled layer's training output differs
    from a dropout-free twin's, and scales the kept activations by ``1 / (1 - p)`` (p = 0.5: the outputs of
    many draws average to the dropout-free output)."""
    inductor = CompileCounterWithBackend("inductor")
    monkeypatch.setattr(moe_layer, "COMPILE_BACKEND", inductor)
    layer = _layer(subln=False, dropout=0.5)
    plain = copy.deepcopy(layer)
    plain.experts.activation_dropout = 0.0
    layer.compiled_experts = True
    x, padding = _batch()
    with torch.no_grad():
        expected = plain(x, padding)[0].float()
        draws = torch.stack([layer(x, padding)[0].float() for _ in range(400)])
    assert inductor.frame_count == 1
    assert not torch.allclose(draws[0], expected)
    assert torch.allclose(draws.mean(0), expected, atol=0.15 * expected.abs().max().item())


def test_combine_is_one_graph_shared_by_the_layers_and_new_batches_compile_no_more():
    """One graph without a break; three layers with their own weights call it (a graph specialised per layer
    would compile three); token counts 20, 24, 28 and 32 per sequence, with and without padding: a static
    and a dynamic entry, no more."""
    layer = _layer().train()
    x, padding = _batch()
    tokens = x.reshape(-1, 16)
    plan = layer._routing(tokens, ~padding.reshape(-1), False, None, True)[-1]
    explained = torch._dynamo.explain(GroupedExperts.combine)(layer.experts, tokens, plan.token, plan.gate,
                                                              plan.groups)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    counter = CompileCounter()
    moe_layer.COMPILE_BACKEND = counter
    layers = [_layer(seed=seed).train() for seed in range(3)]
    for length in (20, 24, 28, 32):
        for padded in (True, False):
            x, padding = _batch(length, seed=length)
            for layer in layers:
                layer.compiled_experts = False
                expected = layer(x, padding if padded else None)[0]
                layer.compiled_experts = True
                assert torch.allclose(layer(x, padding if padded else None)[0], expected, rtol=1e-2, atol=1e-3)
    assert counter.frame_count == 2  # the first token count's static entry, then one dynamic entry for the rest


@pytest.mark.parametrize("change,why", [
    (dict(compiled_experts=False), "the flag is off"),
    (dict(memo=RecomputeMemo()), "activation checkpointing (the recomputation replays the first run's draws)"),
    (dict(incremental=True), "incremental decoding"),
])
def test_combine_stays_eager_where_a_graph_would_not_pay_or_replay(change, why):
    layer = MoELayer(MoEConfig(expert_count=8, top_k=2), FFNSpec(16, 24))
    layer.compiled_experts = change.get("compiled_experts", True)
    assert layer._combines_compiled(False, None) == ("compiled_experts" not in change), why
    assert not layer._combines_compiled(change.get("incremental", False), change.get("memo")), why


def test_under_ts_compile_the_experts_trace_into_the_layers_graph(counted_backend):
    """Inside an outer ``torch.compile`` (``--ts-compile``) the flag adds no graph of its own: the combine is
    traced into the layer's graph, which computes what the eager layer does."""
    layer = _layer().train()
    plain = copy.deepcopy(layer)
    layer.compiled_experts = True
    x, padding = _batch()
    torch.manual_seed(0)
    expected = plain(x, padding)[0]
    torch.manual_seed(0)
    got = torch.compile(layer, backend="aot_eager")(x, padding)[0]
    assert counted_backend.frames == 0
    assert torch.allclose(got, expected, rtol=1e-2, atol=1e-3)


def test_a_layer_off_the_fused_path_says_once_that_its_experts_run_eagerly(caplog, monkeypatch):
    """One GEMM per expert (the CPU's default): the layer runs as without the flag, and one line says why."""
    monkeypatch.setattr(moe_layer, "_EAGER_COMBINE_LOGGED", set())
    layer = _layer()
    layer.experts.grouped_mm = False
    plain = copy.deepcopy(layer)
    layer.compiled_experts = True
    x, padding = _batch()
    with caplog.at_level("INFO", logger=moe_layer.__name__):
        for _ in range(2):
            torch.manual_seed(0)
            expected = plain(x, padding)[0]
            torch.manual_seed(0)
            assert torch.equal(layer(x, padding)[0], expected)
    lines = [r.getMessage() for r in caplog.records if "--moe-compiled-experts" in r.getMessage()]
    assert lines == ["--moe-compiled-experts on: the experts run eagerly, as the expert GEMMs run one per expert "
                     "(grouped GEMMs: see experts.grouped_mm_fits)"]


def test_the_flag_reaches_every_moe_layer_and_refuses_other_values():
    class Args:
        moe_expert_count = 4
        moe_compiled_experts = "on"

    assert MoELayer(moe_config_from_args(Args()), FFNSpec(16, 24)).compiled_experts is True
    assert MoELayer(MoEConfig(expert_count=4), FFNSpec(16, 24)).compiled_experts is False
    Args.moe_compiled_experts = "auto"
    with pytest.raises(TsConfigError, match=r"^--moe-compiled-experts 'auto' is unknown: choose one of off, on$"):
        moe_config_from_args(Args())
