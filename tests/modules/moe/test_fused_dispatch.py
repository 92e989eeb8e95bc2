"""The fused dispatch of an MoE layer at expert-parallel size 1 (``MoELayer.fused_dispatch``: the
row order from the slots, the gather inside fc1, the weighted combine inside fc2) against the
step-by-step path it replaces (a second stable sort, a permuted copy of the tokens, a weighted copy
of the rows and an ``index_add``): the same output, gradients and Adam updates; and the whole fused
layer as one graph (the routing alone, compiled: ``test_compiled_routing.py``). The fused path runs
with grouped GEMMs only; with one GEMM per expert the layer takes the reference path."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.moe_adam_steps import adam_steps
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.aux_loss import aux_loss_scales
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.gating import dispatch_plan
from torchscale_fairseq.modules.moe.layer import MoELayer

ROUTINGS = [  # (router, top-k, second-expert policy, capacity factor, Sub-LN)
    ("xmoe", 2, "random", 1.0, False),
    ("linear", 1, "all", 0.5, True),
    ("linear", 4, "random", 1.25, False),
    ("expert_choice", 2, "all", 1.0, False),
    ("torchscale_xmoe", 2, "sampling", 0.0, True),
]


def _layer(router: str, top_k: int, policy: str, factor: float, subln: bool, grouped: bool) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(expert_count=8, top_k=top_k, router=router, capacity_factor=factor,
                    second_expert_policy=policy)
    layer = MoELayer(cfg, FFNSpec(16, 24, subln=subln, activation_dropout=0.1))
    layer.experts.grouped_mm = grouped
    return layer


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, 20, 16, generator=torch.Generator().manual_seed(1))
    padding = torch.zeros(3, 20, dtype=torch.bool)
    padding[1, 13:] = True
    return x, padding


def _train(layer: MoELayer, fused: bool, steps: int = 2) -> list[torch.Tensor]:
    """What :func:`adam_steps` records of ``steps`` Adam updates on the fused or the reference path."""
    assert layer.experts.runs_grouped(torch.ones(1))
    layer.fused_dispatch = fused
    x, padding = _batch()
    return adam_steps(layer, x, padding, torch.randn(16, generator=torch.Generator().manual_seed(2)), steps)


@pytest.mark.parametrize("routing", ROUTINGS, ids=[r[0] + f"-top{r[1]}" for r in ROUTINGS])
def test_fused_dispatch_trains_as_the_reference(routing):
    """Grouped GEMMs (forced: on the CPU a loop inside ``torch._grouped_mm``), where the fused path runs."""
    reference = _layer(*routing, True)
    fused = copy.deepcopy(reference)
    expected, got = _train(reference, False), _train(fused, True)
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"tensor {i}: {(a - b).abs().max()}"


@pytest.mark.parametrize("routing", ROUTINGS, ids=[r[0] + f"-top{r[1]}" for r in ROUTINGS])
def test_dispatch_plan_is_the_stable_sort_by_expert(routing):
    """Rows of kept assignments by expert in priority order, then the unkept in their order."""
    layer = _layer(*routing, False).train()
    x, padding = _batch()
    tokens = x.reshape(-1, 16)
    _, r = layer.route(layer.router(tokens), real=~padding.reshape(-1))
    expert = torch.where(r.kept, r.expert, layer.cfg.expert_count).tolist()
    order = sorted(range(len(expert)), key=lambda a: expert[a])  # Python's sort is stable
    plan = dispatch_plan(r, layer.cfg.expert_count)
    assert plan.token.tolist() == r.token[order].tolist()
    assert torch.equal(plan.gate, r.gate[order])
    assert plan.counts.tolist() == [expert.count(e) for e in range(layer.cfg.expert_count)]
    assert int(plan.counts.sum()) < len(expert) or routing[0] == "expert_choice"  # some unkept rows tested


def test_fused_layer_compiles_without_graph_break():
    """The whole layer's forward (grouped GEMMs, which compile traces in bf16 only; aux losses
    attached) as one graph."""
    layer = _layer("xmoe", 2, "random", 1.25, False, True).train().to(torch.bfloat16)
    (layer.aux_loss_scale,) = aux_loss_scales([8], [False], 0.1, 0.01, 1.0, torch.device("cpu"))
    x, padding = _batch()
    x = x.to(torch.bfloat16)

    def step(tokens):
        out, aux = layer(tokens, padding)
        return out, aux.balance_loss

    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
