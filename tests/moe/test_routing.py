"""Routers, capacity and dispatch against independent references (loops, one-hot einsum)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.moe.capacity import assign_slots, expert_capacity
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.gating import expert_choice_routing, top_k_routing
from torchscale_fairseq.modules.moe.layer import MoELayer
from torchscale_fairseq.modules.moe.routers import XMoERouter


def _probs(t: int, e: int, seed: int = 0) -> torch.Tensor:
    return torch.softmax(torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * 2, dim=-1)


def _expert_ffn(layer: MoELayer, e: int, x: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    h = F.gelu(x @ ex.fc1_weight[e] + ex.fc1_bias[e])
    if ex.ln_weight is not None:
        h = F.layer_norm(h, h.shape[-1:], ex.ln_weight[e], ex.ln_bias[e], eps=ex.layernorm_eps)
    return h @ ex.fc2_weight[e] + ex.fc2_bias[e]


def test_capacity_formula():
    assert expert_capacity(100, 8, 2, 1.0) == math.ceil(100 * 2 / 8)
    assert expert_capacity(100, 8, 1, 1.25) == math.ceil(1.25 * 100 / 8)
    assert expert_capacity(100, 8, 2, 0.0) == 100
    assert expert_capacity(10, 2, 2, 4.0) == 10


def test_slots_rank_within_expert_in_order():
    expert = torch.tensor([2, 0, 2, 1, 0, 2])
    assert assign_slots(expert, 3).tolist() == [0, 0, 1, 0, 1, 2]


@pytest.mark.parametrize("k", [1, 2])
def test_top_k_choice_capacity_and_first_choice_priority(k):
    probs = _probs(64, 4)
    r = top_k_routing(probs, k, capacity_factor=0.5, second_expert_policy="all")
    cap = expert_capacity(64, 4, k, 0.5)
    top = probs.topk(k, dim=-1).indices
    for t, e in zip(r.token.tolist(), r.expert.tolist()):
        assert e in top[t].tolist()
    counts = torch.bincount(r.expert, minlength=4)
    assert int(counts.max()) <= cap
    pairs = set(zip(r.expert.tolist(), r.slot.tolist()))
    assert len(pairs) == r.token.numel()
    first_kept = {(t, e) for t, e in zip(r.token.tolist(), r.expert.tolist()) if e == int(top[t, 0])}
    for e in range(4):
        n_first = int((top[:, 0] == e).sum())
        assert sum(1 for (_, ee) in first_kept if ee == e) == min(n_first, cap)


def test_top2_gates_sum_to_one_after_dropping():
    probs = _probs(64, 4, 1)
    r = top_k_routing(probs, 2, capacity_factor=0.6, second_expert_policy="all")
    sums = torch.zeros(64).index_add(0, r.token, r.gate)
    served = torch.zeros(64, dtype=torch.bool)
    served[r.token] = True
    assert torch.allclose(sums[served], torch.ones(int(served.sum())), atol=1e-6)


def test_top2_normalize_before_dropping():
    probs = _probs(64, 4, 2)
    r = top_k_routing(probs, 2, capacity_factor=0.6, second_expert_policy="all", normalize_before_dropping=True)
    top = probs.topk(2, dim=-1)
    expected = top.values / top.values.sum(-1, keepdim=True)
    for t, e, g in zip(r.token.tolist(), r.expert.tolist(), r.gate.tolist()):
        j = top.indices[t].tolist().index(e)
        assert g == pytest.approx(float(expected[t, j]), abs=1e-6)


def test_top1_gate_is_probability():
    probs = _probs(32, 4, 3)
    r = top_k_routing(probs, 1, capacity_factor=0.0)
    assert torch.allclose(r.gate, probs.max(-1).values[r.token])
    assert r.dropped == 0


def test_second_expert_sampling_keeps_with_gate_probability():
    torch.manual_seed(0)
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0]]).repeat(20000, 1)
    r = top_k_routing(probs, 2, capacity_factor=0.0, second_expert_policy="sampling")
    kept = (r.expert == 1).sum() / 20000
    assert float(kept) == pytest.approx(2 * 0.3 / 0.9, abs=0.02)
    r_eval = top_k_routing(probs, 2, 0.0, "sampling", training=False)
    assert int((r_eval.expert == 1).sum()) == 20000


def test_expert_choice_each_expert_takes_its_top_tokens():
    probs = _probs(40, 4, 4)
    r = expert_choice_routing(probs, 1, capacity_factor=1.0)
    cap = expert_capacity(40, 4, 1, 1.0)
    for e in range(4):
        chosen = sorted(r.token[r.expert == e].tolist())
        assert chosen == sorted(probs[:, e].topk(cap).indices.tolist())


def test_xmoe_router_is_cosine_over_temperature_in_fp32():
    router = XMoERouter(16, 8, 16)
    x = torch.randn(5, 16).to(torch.bfloat16)
    s = router(x)
    assert s.dtype == torch.float32
    tau = router.log_temperature.exp()
    assert float((s * tau).abs().max()) <= 1.0 + 1e-5
    proj = F.normalize(router.proj(x.float()), dim=-1)
    emb = F.normalize(router.expert_embeddings, dim=-1)
    assert torch.allclose(s, proj @ emb.t() / tau, atol=1e-4)


@pytest.mark.parametrize("router,k", [("xmoe", 1), ("xmoe", 2), ("linear", 2), ("expert_choice", 1)])
def test_layer_equals_per_token_loop_and_dropped_tokens_are_zero(router, k):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(expert_count=4, top_k=k, router=router, capacity_factor=0.5,
                               second_expert_policy="all"), 8, 16, subln=True)
    x = torch.randn(2, 12, 8)
    y = layer(x).reshape(-1, 8)
    tokens = x.reshape(-1, 8)
    _, r = layer.route(tokens)
    ref = torch.zeros_like(tokens)
    for t, e, g in zip(r.token.tolist(), r.expert.tolist(), r.gate.tolist()):
        ref[t] += g * _expert_ffn(layer, e, tokens[t])
    assert torch.allclose(y, ref, atol=1e-5)
    served = torch.zeros(tokens.size(0), dtype=torch.bool)
    served[r.token] = True
    assert (~served).any(), "capacity 0.5 must drop some tokens"
    assert torch.equal(y[~served], torch.zeros_like(y[~served]))


def test_index_dispatch_equals_one_hot_einsum():
    torch.manual_seed(1)
    layer = MoELayer(MoEConfig(expert_count=4, top_k=2, capacity_factor=1.0, second_expert_policy="all"), 8, 16)
    tokens = torch.randn(20, 8)
    _, r = layer.route(tokens)
    cap = int(r.slot.max()) + 1
    combine = torch.zeros(20, 4, cap)
    combine[r.token, r.expert, r.slot] = r.gate
    dispatch = (combine > 0).float()
    expert_in = torch.einsum("tec,td->ecd", dispatch, tokens)
    expert_out = layer.experts(expert_in.reshape(-1, 8), [cap] * 4).view(4, cap, 8)
    ref = torch.einsum("tec,ecd->td", combine, expert_out)
    assert torch.allclose(layer.dispatch_combine(tokens, r), ref, atol=1e-5)


def test_expert_choice_refuses_incremental_decoding():
    layer = MoELayer(MoEConfig(expert_count=2, top_k=1, router="expert_choice"), 8, 16).eval()
    with pytest.raises(TsConfigError, match="incremental"):
        layer(torch.randn(1, 1, 8), incremental=True)


def test_eval_never_drops_by_default():
    layer = MoELayer(MoEConfig(expert_count=4, top_k=2, capacity_factor=0.1), 8, 16).eval()
    layer(torch.randn(4, 16, 8))
    assert layer.stats.dropped == 0
