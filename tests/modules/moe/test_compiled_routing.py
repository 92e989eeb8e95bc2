"""``--moe-compiled-routing on``: :meth:`MoELayer._routing` (router, softmax, top-k, slots, gates, the
fused dispatch's rows, balance loss, z-loss, statistics) through ``torch.compile`` as one graph, against
the same layer routing eagerly (the reference path): the same outputs, gradients, Adam updates, losses,
statistics and expert loads to float rounding (``aot_eager``: dynamo and AOTAutograd trace it as
inductor does, and the random draws are eager's), the same with inductor's own kernels, one graph with
no break, new token counts and padding without a compile per batch, and the eager path wherever the
graph would need the host or another rank."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from tests.helpers.moe_adam_steps import adam_steps
from tests.helpers.moe_compile_counting import counted_moe_compiles
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe import layer as moe_layer
from torchscale_fairseq.modules.moe.config import MoEConfig, moe_config_from_args
from torchscale_fairseq.modules.moe.layer import MoELayer, RecomputeMemo, update_expert_biases

ROUTINGS = [  # (router, top-k, second-expert policy, capacity factor, gate noise, aux-loss-free bias rate)
    ("xmoe", 2, "random", 1.0, 0.0, 0.0),
    ("xmoe", 1, "all", 0.5, 0.0, 0.0),
    ("linear", 2, "coin", 1.25, 0.5, 0.0),
    ("linear", 4, "random", 0.0, 0.0, 1e-3),
]
PATHS = [(torch.float32, False), (torch.bfloat16, True)]  # one GEMM per expert; grouped GEMMs (the fused dispatch)


@pytest.fixture(autouse=True)
def aot_eager_routing(monkeypatch):
    """The compiled routing on a counted ``aot_eager`` (:func:`counted_moe_compiles`)."""
    with counted_moe_compiles(monkeypatch) as backend:
        yield backend


def _layer(router: str, top_k: int, policy: str, factor: float, noise: float, bias_rate: float,
           dtype: torch.dtype = torch.float32, grouped: bool = False) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(expert_count=8, top_k=top_k, router=router, capacity_factor=factor, second_expert_policy=policy,
                    gate_noise=noise, router_bias_update_rate=bias_rate)
    layer = MoELayer(cfg, FFNSpec(16, 24, subln=True, activation_dropout=0.1)).to(dtype)
    layer.experts.grouped_mm = grouped
    return layer


def _batch(dtype: torch.dtype, tokens: int = 20, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, tokens, 16, generator=torch.Generator().manual_seed(seed)).to(dtype)
    padding = torch.zeros(3, tokens, dtype=torch.bool)
    padding[1, tokens * 2 // 3:] = True
    return x, padding


def _train(layer: MoELayer, compiled: bool, dtype: torch.dtype, steps: int = 2) -> list[torch.Tensor]:
    """What :func:`adam_steps` records of ``steps`` Adam updates, with the expert loads and an aux-loss-free
    bias moved after each, then a validation forward's output and losses."""
    layer.compiled_routing = compiled
    layer.train()
    x, padding = _batch(dtype)

    def move_bias(layer: MoELayer) -> list[torch.Tensor]:
        if layer.expert_load is None:
            return []
        load = layer.expert_load.clone()
        update_expert_biases(layer, None)
        return [load, layer.expert_bias.clone()]

    weight = torch.randn(16, generator=torch.Generator().manual_seed(2)).to(dtype)
    seen = adam_steps(layer, x, padding, weight, steps, move_bias)
    layer.eval()
    with torch.no_grad():
        out, aux = layer(x, padding)
    return seen + [out, aux.balance_loss, aux.z_loss]


@pytest.mark.parametrize("dtype,grouped", PATHS, ids=["fp32-loop", "bf16-grouped"])
@pytest.mark.parametrize("routing", ROUTINGS, ids=[f"{r[0]}-top{r[1]}-{r[2]}" for r in ROUTINGS])
def test_compiled_routing_trains_as_the_eager_routing(routing, dtype, grouped, aot_eager_routing):
    eager = _layer(*routing, dtype=dtype, grouped=grouped)
    compiled = copy.deepcopy(eager)
    expected = _train(eager, False, dtype)
    assert aot_eager_routing.calls == 0
    got = _train(compiled, True, dtype)
    # the routing ran compiled at every step and in validation: a graph for training, one for validation
    assert (aot_eager_routing.frames, aot_eager_routing.calls) == (2, 3)
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):  # to the rounding of each tensor's type (decompositions round)
        rtol, atol = (1e-2, 1e-3) if a.dtype == torch.bfloat16 else (1e-5, 1e-6)
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=rtol, atol=atol), \
            f"tensor {i}: {(a.double() - b.double()).abs().max()}"


def test_routing_is_one_graph_and_new_batches_compile_no_more():
    """One graph without a break; token counts 20, 24, 28 and 32 per sequence and batches with and without
    padding: at most a static and a dynamic entry for each of the two (not one per batch)."""
    layer = _layer("xmoe", 2, "random", 1.0, 0.0, 0.0).train()
    x, padding = _batch(torch.float32)
    tokens, real = x.reshape(-1, 16), ~padding.reshape(-1)
    explained = torch._dynamo.explain(MoELayer._routing)(layer, tokens, real, False, None, True)  # + dispatch rows
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    counter = CompileCounter()
    moe_layer.COMPILE_BACKEND = counter
    reference = copy.deepcopy(layer)
    reference.compiled_routing = False
    layer.compiled_routing = True
    for length in (20, 24, 28, 32):
        for padded in (True, False):
            x, padding = _batch(torch.float32, length, seed=length)
            mask = padding if padded else None
            torch.manual_seed(length)
            expected = reference(x, mask)[0]
            torch.manual_seed(length)
            assert torch.equal(layer(x, mask)[0], expected)
    assert counter.frame_count <= 4


def test_the_moe_layers_of_a_model_share_one_graph(aot_eager_routing):
    """Three MoE layers with their own weights and bias: one graph, called by each, each layer's output
    that of its own eager routing (a graph specialised per layer would compile three)."""
    layers = [_layer("xmoe", 2, "random", 1.0, 0.0, 1e-3) for _ in range(3)]
    for seed, layer in enumerate(layers):
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
            layer.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(seed)))
    x, padding = _batch(torch.float32)
    for layer in layers:
        reference = copy.deepcopy(layer)
        layer.compiled_routing, reference.compiled_routing = True, False
        torch.manual_seed(7)
        expected = reference(x, padding)[0]
        torch.manual_seed(7)
        assert torch.allclose(layer(x, padding)[0], expected, rtol=1e-5, atol=1e-6)
    assert (aot_eager_routing.frames, aot_eager_routing.calls) == (1, 3)


def test_inductor_kernels_route_as_the_eager_routing():
    """Inductor's generated kernels (C++ on the CPU, Triton on a GPU; tests/gpu checks those), policy
    ``all`` (inductor draws its own random numbers): the same routing, outputs and gradients within
    float tolerance."""
    moe_layer.COMPILE_BACKEND = "inductor"
    eager = _layer("xmoe", 2, "all", 1.0, 0.0, 0.0)
    compiled = copy.deepcopy(eager)
    expected, got = _train(eager, False, torch.float32, steps=1), _train(compiled, True, torch.float32, steps=1)
    for i, (a, b) in enumerate(zip(expected, got)):  # float32 rounding of the tensor's scale (fused reductions)
        assert (a.double() - b.double()).abs().max() <= 1e-5 * a.double().abs().max() + 1e-6, f"tensor {i}"


@pytest.mark.parametrize("part", ["compiled_routing", "compiled_combine"])
def test_inductor_compiles_the_moe_parts_with_combo_kernels(part, monkeypatch):
    """Inductor is asked for combo kernels, which launch a graph's independent kernels as one on a GPU (the
    routing's many small ones; the C++ kernels of the CPU have no such fusion, and the inductor tests above
    compile with the option on); a backend other than inductor is given no inductor option."""
    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: asked.append(kwargs) or fn)
    compile_part = getattr(moe_layer, part)
    compile_part.cache_clear()
    try:
        compile_part("inductor")
        compile_part("aot_eager")
    finally:
        compile_part.cache_clear()
    assert asked == [{"backend": "inductor", "options": {"combo_kernels": True}},
                     {"backend": "aot_eager", "options": None}]


@pytest.mark.parametrize("change,why", [
    (dict(compiled_routing=False), "the flag is off"),
    (dict(memo=RecomputeMemo()), "activation checkpointing (the recomputation replays the first run)"),
    (dict(incremental=True), "incremental decoding"),
    (dict(context_group=object()), "context parallelism sums the statistics over ranks"),
    (dict(cfg=dict(balance_scope="global")), "the global balance scope sums the counts over ranks"),
    (dict(cfg=dict(second_expert_policy="sampling")), "the Gumbel draw"),
    (dict(cfg=dict(router="torchscale_xmoe")), "TorchScale's gate rescales its embeddings in place"),
    (dict(cfg=dict(router="expert_choice")), "expert choice reads its capacity on the host"),
])
def test_routing_stays_eager_where_the_graph_needs_the_host_or_other_ranks(change, why):
    cfg = MoEConfig(expert_count=8, top_k=2, **change.get("cfg", {}))
    layer = MoELayer(cfg, FFNSpec(16, 24))
    layer.compiled_routing = change.get("compiled_routing", True)
    layer.context_group = change.get("context_group")
    assert layer._routes_compiled(False, None) == (not change or "memo" in change or "incremental" in change), why
    assert not layer._routes_compiled(change.get("incremental", False), change.get("memo")), why


def test_the_flag_reaches_every_moe_layer_and_refuses_other_values():
    class Args:
        moe_expert_count = 4
        moe_compiled_routing = "on"

    cfg = moe_config_from_args(Args())
    assert MoELayer(cfg, FFNSpec(16, 24)).compiled_routing is True
    assert MoELayer(MoEConfig(expert_count=4), FFNSpec(16, 24)).compiled_routing is False
    Args.moe_compiled_routing = "auto"
    with pytest.raises(TsConfigError, match=r"^--moe-compiled-routing 'auto' is unknown: choose one of off, on$"):
        moe_config_from_args(Args())
