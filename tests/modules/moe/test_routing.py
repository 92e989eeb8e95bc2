"""Routers, capacity and dispatch against independent references (loops, one-hot einsum)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.capacity import assign_slots, expert_capacity, expert_counts
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.gating import Routing, expert_choice_routing, top_k_routing
from torchscale_fairseq.modules.moe.layer import MoELayer
from torchscale_fairseq.modules.moe.routers import XMoERouter


def _probs(t: int, e: int, seed: int = 0) -> torch.Tensor:
    return torch.softmax(torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * 2, dim=-1)


def kept(r: Routing) -> SimpleNamespace:
    """A routing plan's kept assignments (``token``, ``expert``, ``slot``, ``gate``) and its counts as ints."""
    token, expert, slot, gate = r.kept_assignments()
    return SimpleNamespace(token=token, expert=expert, slot=slot, gate=gate, dropped=int(r.dropped),
                           routed=int(r.routed))


def expert_ffn(layer: MoELayer, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of ``layer`` on ``x`` from its stacked weights (gelu, optional Sub-LN)."""
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


def test_expert_counts_are_int32_counts():
    """int32 (which inductor adds atomically in its own kernel), equal to Python's count, empty experts 0."""
    expert = torch.tensor([2, 0, 2, 1, 0, 2, 4])
    counts = expert_counts(expert, 6)
    assert counts.dtype == torch.int32 and counts.tolist() == [expert.tolist().count(e) for e in range(6)]


def test_slots_rank_within_expert_in_order():
    expert = torch.tensor([2, 0, 2, 1, 0, 2])
    assert assign_slots(expert, 3).tolist() == [0, 0, 1, 0, 1, 2]


@pytest.mark.parametrize("k", [1, 2])
def test_top_k_choice_capacity_and_first_choice_priority(k):
    probs = _probs(64, 4)
    r = top_k_routing(probs, k, capacity_factor=0.5, second_expert_policy="all")
    r = kept(r)
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
    r = kept(r)
    sums = torch.zeros(64).index_add(0, r.token, r.gate)
    served = torch.zeros(64, dtype=torch.bool)
    served[r.token] = True
    assert torch.allclose(sums[served], torch.ones(int(served.sum())), atol=1e-6)


def test_top2_normalize_before_dropping():
    probs = _probs(64, 4, 2)
    r = top_k_routing(probs, 2, capacity_factor=0.6, second_expert_policy="all", normalize_before_dropping=True)
    r = kept(r)
    top = probs.topk(2, dim=-1)
    expected = top.values / top.values.sum(-1, keepdim=True)
    for t, e, g in zip(r.token.tolist(), r.expert.tolist(), r.gate.tolist()):
        j = top.indices[t].tolist().index(e)
        assert g == pytest.approx(float(expected[t, j]), abs=1e-6)


def test_top1_gate_is_probability():
    probs = _probs(32, 4, 3)
    r = top_k_routing(probs, 1, capacity_factor=0.0)
    r = kept(r)
    assert torch.allclose(r.gate, probs.max(-1).values[r.token])
    assert r.dropped == 0


def _upstream_top2_masks(logits: torch.Tensor, policy: str, normalize_before: bool):
    """fairseq MoE branch ``fairseq/modules/moe/top2gate.py`` / TorchScale
    ``torchscale/component/xmoe/routing.py`` ``top2gating``, transcribed up to the capacity
    step (no padding, no dropping): the first- and second-expert masks and the combine
    weights, normalised over both experts as upstream does when nothing is dropped."""
    gates = torch.softmax(logits, dim=1)
    num_experts = gates.shape[1]
    mask1 = F.one_hot(gates.argmax(dim=1), num_experts)
    if policy == "sampling":
        gumbel = torch.distributions.gumbel.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample
        logits_w_noise = logits + gumbel(logits.shape)
    else:
        logits_w_noise = logits
    mask2 = F.one_hot(logits_w_noise.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1), num_experts)
    gates1_s, gates2_s = (gates * mask1).sum(dim=1), (gates * mask2).sum(dim=1)
    if normalize_before:
        denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
        gates1_s, gates2_s = gates1_s / denom_s, gates2_s / denom_s
    if policy == "random":
        sampled = (2 * gates2_s) > torch.rand_like(gates2_s)
        mask2 = mask2 * sampled.repeat(num_experts, 1).transpose(1, 0)
    if not normalize_before:
        gates1_s, gates2_s = (gates * mask1).sum(dim=1), (gates * mask2).sum(dim=1)
        denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
        gates1_s, gates2_s = gates1_s / denom_s, gates2_s / denom_s
    combine = gates1_s.unsqueeze(1) * mask1 + gates2_s.unsqueeze(1) * mask2
    return mask1, mask2, combine


def _our_top2_masks(probs: torch.Tensor, policy: str, normalize_before: bool, training: bool = True):
    num_tokens, num_experts = probs.shape
    r = top_k_routing(probs, 2, capacity_factor=0.0, second_expert_policy=policy,
                      normalize_before_dropping=normalize_before, training=training)
    r = kept(r)
    assert r.dropped == 0 and torch.equal(r.token[:num_tokens], torch.arange(num_tokens))
    mask1 = torch.zeros(num_tokens, num_experts, dtype=torch.long)
    mask1[r.token[:num_tokens], r.expert[:num_tokens]] = 1
    mask2 = torch.zeros_like(mask1)
    mask2[r.token[num_tokens:], r.expert[num_tokens:]] = 1
    combine = torch.zeros(num_tokens, num_experts).index_put((r.token, r.expert), r.gate)
    return mask1, mask2, combine


@pytest.mark.parametrize("policy", ["all", "random", "sampling"])
@pytest.mark.parametrize("normalize_before", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_second_expert_policies_equal_upstream_top2gating(policy, normalize_before, seed):
    """Same seed, same draws: the kept second experts and the combine weights are those of
    upstream ``top2gating`` with the same ``--moe-second-expert-policy``."""
    logits = torch.randn(256, 8, generator=torch.Generator().manual_seed(seed)) * 2
    torch.manual_seed(100 + seed)
    ref1, ref2, ref_combine = _upstream_top2_masks(logits, policy, normalize_before)
    torch.manual_seed(100 + seed)
    our1, our2, our_combine = _our_top2_masks(torch.softmax(logits, 1), policy, normalize_before)
    assert torch.equal(our1, ref1)
    assert torch.equal(our2, ref2)
    assert torch.allclose(our_combine, ref_combine, atol=1e-6)
    kept = int(ref2.sum())
    if policy == "all":
        assert kept == 256
    else:
        assert 0 < kept <= 256
    if policy == "sampling":
        top2 = logits.topk(2, dim=1).indices[:, 1]
        assert bool((ref2.argmax(1) != top2).any()), "Gumbel sampling must sometimes pick another expert"


def test_coin_policy_keeps_the_second_best_with_probability_half():
    """``coin`` (not upstream): the second-best expert, kept when ``U(0, 1) < 1/2``."""
    probs = _probs(512, 4, 5)
    torch.manual_seed(3)
    keep = torch.rand(512) < 0.5
    torch.manual_seed(3)
    _, our2, _ = _our_top2_masks(probs, "coin", False)
    ref2 = F.one_hot(probs.topk(2, dim=1).indices[:, 1], 4) * keep.unsqueeze(1)
    assert torch.equal(our2, ref2)


@pytest.mark.parametrize("policy", ["random", "sampling", "coin"])
def test_evaluation_keeps_the_second_best_expert(policy):
    probs = _probs(64, 4, 6)
    _, our2, _ = _our_top2_masks(probs, policy, False, training=False)
    assert torch.equal(our2, F.one_hot(probs.topk(2, dim=1).indices[:, 1], 4))


def test_expert_choice_each_expert_takes_its_top_tokens():
    probs = _probs(40, 4, 4)
    r = expert_choice_routing(probs, 1, capacity_factor=1.0)
    r = kept(r)
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
                               second_expert_policy="all"), FFNSpec(8, 16, subln=True))
    x = torch.randn(2, 12, 8)
    y = layer(x)[0].reshape(-1, 8)
    tokens = x.reshape(-1, 8)
    _, r = layer.route(layer.router(tokens))
    r = kept(r)
    ref = torch.zeros_like(tokens)
    for t, e, g in zip(r.token.tolist(), r.expert.tolist(), r.gate.tolist()):
        ref[t] += g * expert_ffn(layer, e, tokens[t])
    assert torch.allclose(y, ref, atol=1e-5)
    served = torch.zeros(tokens.size(0), dtype=torch.bool)
    served[r.token] = True
    assert (~served).any(), "capacity 0.5 must drop some tokens"
    assert torch.equal(y[~served], torch.zeros_like(y[~served]))


def test_index_dispatch_equals_one_hot_einsum():
    torch.manual_seed(1)
    layer = MoELayer(MoEConfig(expert_count=4, top_k=2, capacity_factor=1.0, second_expert_policy="all"), FFNSpec(8, 16))
    tokens = torch.randn(20, 8)
    _, plan = layer.route(layer.router(tokens))
    r = kept(plan)
    cap = int(r.slot.max()) + 1
    combine = torch.zeros(20, 4, cap)
    combine[r.token, r.expert, r.slot] = r.gate
    dispatch = (combine > 0).float()
    expert_in = torch.einsum("tec,td->ecd", dispatch, tokens)
    expert_out = layer.experts(expert_in.reshape(-1, 8), [cap] * 4).view(4, cap, 8)
    ref = torch.einsum("tec,ecd->td", combine, expert_out)
    assert torch.allclose(layer._combine_stepwise(tokens, plan, None), ref, atol=1e-5)


def test_expert_choice_refuses_incremental_decoding():
    layer = MoELayer(MoEConfig(expert_count=2, top_k=1, router="expert_choice"), FFNSpec(8, 16)).eval()
    with pytest.raises(TsConfigError, match="incremental"):
        layer(torch.randn(1, 1, 8), incremental=True)


def test_eval_never_drops_by_default():
    layer = MoELayer(MoEConfig(expert_count=4, top_k=2, capacity_factor=0.1), FFNSpec(8, 16)).eval()
    _, aux = layer(torch.randn(4, 16, 8))
    assert aux.stats.dropped == 0
