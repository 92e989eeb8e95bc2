"""Fine-grained top-k with narrower experts, shared experts and auxiliary-loss-free balancing
(issue 26 item 3) against naive per-token references written from the definitions:
DeepSeekMoE (fine-grained and shared experts), DeepSeek-V3 section 2.1.2 (the bias is added
for the choice only and moves by ``rate * sign(mean load - load)`` after each update) and
GShard's capacity (all first choices before any second choice, then in token order)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.modules.moe.test_routing import expert_ffn
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig, check_moe_config
from torchscale_fairseq.modules.moe.layer import MoELayer, discard_expert_loads, update_expert_biases


def naive_routing(probs: torch.Tensor, k: int, capacity: int, bias: torch.Tensor | None = None):
    """Per token: the ``k`` experts of largest ``p + bias`` (largest first), gates ``p``; slots
    handed out choice rank by choice rank, in token order within a rank; a token's gates
    renormalised over its kept experts (top-1: ``p`` as is). Returns ``{token: [(expert, gate)]}``."""
    t, e = probs.shape
    choice_scores = probs + (bias if bias is not None else 0.0)
    chosen = [sorted(range(e), key=lambda j: -float(choice_scores[i, j]))[:k] for i in range(t)]
    used = [0] * e
    kept: dict[int, list[int]] = {i: [] for i in range(t)}
    for rank in range(k):
        for i in range(t):
            expert = chosen[i][rank]
            if used[expert] < capacity:
                used[expert] += 1
                kept[i].append(expert)
    out = {}
    for i, experts in kept.items():
        gates = [float(probs[i, j]) for j in experts]
        total = sum(gates) if k > 1 else 1.0
        out[i] = [(j, g / total) for j, g in zip(experts, gates)]
    return out


def dense_ffn(ffn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``fc2(LN(gelu(fc1 x)))`` from the module's weights (nn.Linear layout ``(out, in)``)."""
    h = F.gelu(F.linear(x, ffn.fc1.weight, ffn.fc1.bias))
    if ffn.ffn_layernorm is not None:
        h = F.layer_norm(h, h.shape[-1:], ffn.ffn_layernorm.weight, ffn.ffn_layernorm.bias, eps=1e-5)
    return F.linear(h, ffn.fc2.weight, ffn.fc2.bias)


def reference_output(layer: MoELayer, tokens: torch.Tensor, capacity_factor: float) -> torch.Tensor:
    probs = torch.softmax(layer.router(tokens), dim=-1)
    n, e = probs.shape
    k = layer.cfg.top_k
    capacity = n if capacity_factor <= 0 else min(n, math.ceil(capacity_factor * n * k / e))
    plan = naive_routing(probs.detach(), k, capacity, layer.expert_bias)
    rows = []
    for t in range(n):
        y = sum((g * expert_ffn(layer, j, tokens[t]) for j, g in plan[t]), torch.zeros_like(tokens[t]))
        if layer.shared_experts is not None:
            y = y + dense_ffn(layer.shared_experts, tokens[t])
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("k,capacity_factor,subln", [(3, 1.0, False), (4, 0.75, True), (8, 0.0, False)])
def test_fine_grained_top_k_equals_the_naive_reference(k, capacity_factor, subln):
    """Narrower experts (``--moe-expert-ffn-dim`` 8 under a dense FFN of 32), top-3 / 4 / 8 of
    16, with dropped tokens (capacity factor 0.75 and 1.0) and without (0)."""
    torch.manual_seed(0)
    cfg = MoEConfig(expert_count=16, top_k=k, expert_ffn_dim=8, capacity_factor=capacity_factor,
                    second_expert_policy="all", router="linear")
    layer = MoELayer(cfg, FFNSpec(12, 32, subln=subln)).train()
    assert layer.experts.fc1_weight.shape == (16, 12, 8)
    with torch.no_grad():
        layer.router.gate.weight.mul_(8.0)  # peaked scores, so that the capacity binds
    x = torch.randn(3, 10, 12)
    y, aux = layer(x)
    ref = reference_output(layer, x.reshape(-1, 12), capacity_factor)
    torch.testing.assert_close(y.reshape(-1, 12), ref, rtol=1e-5, atol=1e-5)
    if capacity_factor == 0.75:
        assert aux.stats.dropped > 0, "capacity 0.75 must drop assignments"


def test_shared_experts_equal_a_dense_ffn_added_to_the_routed_output():
    """Two shared experts of width 6 are one FFN of width 12 every (non-padding) token passes;
    padding tokens still get a zero output."""
    torch.manual_seed(1)
    cfg = MoEConfig(expert_count=8, top_k=2, expert_ffn_dim=6, shared_expert_count=2, capacity_factor=1.0,
                    second_expert_policy="all")
    layer = MoELayer(cfg, FFNSpec(12, 48, subln=True))
    assert layer.shared_experts.fc1.weight.shape == (12, 12)
    x = torch.randn(2, 7, 12)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    y, _ = layer(x, pad)
    real = x[~pad]
    torch.testing.assert_close(y[~pad], reference_output(layer, real, 1.0), rtol=1e-5, atol=1e-5)
    assert torch.equal(y[pad], torch.zeros_like(y[pad]))
    routed_only = MoELayer(MoEConfig(expert_count=8, top_k=2, expert_ffn_dim=6, capacity_factor=1.0,
                                     second_expert_policy="all"), FFNSpec(12, 48, subln=True))
    routed_only.load_state_dict({n: p for n, p in layer.state_dict().items() if not n.startswith("shared_experts.")})
    torch.testing.assert_close(y[~pad] - routed_only(x, pad)[0][~pad], dense_ffn(layer.shared_experts, real),
                               rtol=1e-5, atol=1e-5)


def test_bias_chooses_the_experts_but_not_the_gates():
    torch.manual_seed(2)
    cfg = MoEConfig(expert_count=8, top_k=3, router_bias_update_rate=0.01, capacity_factor=0.0, router="linear")
    layer = MoELayer(cfg, FFNSpec(12, 16)).eval()
    with torch.no_grad():
        layer.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    x = torch.randn(1, 9, 12)
    y, _ = layer(x)
    torch.testing.assert_close(y.reshape(-1, 12), reference_output(layer, x.reshape(-1, 12), 0.0),
                               rtol=1e-5, atol=1e-5)
    unbiased = torch.softmax(layer.router(x.reshape(-1, 12)), -1).topk(3).indices
    _, routing = layer.route(layer.router(x.reshape(-1, 12)))
    assert not torch.equal(routing.first_expert, unbiased[:, 0]), "the bias must change some choices"


def test_bias_update_follows_its_rule_after_the_update():
    """Training forwards (two micro-batches) count each expert's requested assignments; the update
    moves the bias by ``rate * sign(mean - load)``; evaluation and a skipped update count nothing."""
    torch.manual_seed(3)
    rate = 0.05
    layer = MoELayer(MoEConfig(expert_count=6, top_k=2, router_bias_update_rate=rate, capacity_factor=1.0,
                               second_expert_policy="all", router="linear"), FFNSpec(12, 16))
    model = nn.Sequential(layer)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.1, 0.0, -0.1, 0.05, 0.0, 0.0]))
    before = layer.expert_bias.clone()
    batches = [torch.randn(2, 5, 12), torch.randn(1, 8, 12)]
    load = torch.zeros(6)
    for x in batches:
        layer.train()(x)
        probs = torch.softmax(layer.router(x.reshape(-1, 12)), -1).detach()
        for choices in naive_routing(probs, 2, 10**6, before).values():
            for expert, _ in choices:
                load[expert] += 1
    layer.eval()(torch.randn(1, 4, 12))  # not counted
    assert torch.equal(layer.expert_load.float(), load)
    update_expert_biases(model, None)
    torch.testing.assert_close(layer.expert_bias, before + rate * torch.sign(load.mean() - load))
    assert layer.expert_load.sum() == 0
    layer.train()(batches[0])
    discard_expert_loads(model)  # a skipped update
    assert layer.expert_load.sum() == 0
    moved = layer.expert_bias.clone()
    layer.train()(batches[0])
    update_expert_biases(model, None, applied=torch.tensor(0.0))  # skipped on the device (--ts-sync-free-step)
    assert torch.equal(layer.expert_bias, moved) and layer.expert_load.sum() == 0
    layer.train()(batches[1])
    load = layer.expert_load.float().clone()
    update_expert_biases(model, None, applied=torch.tensor(1.0))
    torch.testing.assert_close(layer.expert_bias, moved + rate * torch.sign(load.mean() - load))
    assert "expert_bias" in layer.state_dict() and "expert_load" not in layer.state_dict()


def test_bias_updates_lower_the_load_cv_of_a_skewed_router():
    """A fixed router that sends most tokens to two of eight experts: after 100 updates of the
    bias (rate 1e-2) the load's coefficient of variation is below a third of its start."""
    torch.manual_seed(4)
    layer = MoELayer(MoEConfig(expert_count=8, top_k=2, router_bias_update_rate=0.01, capacity_factor=0.0,
                               second_expert_policy="all", router="linear"), FFNSpec(12, 16)).train()
    with torch.no_grad():
        layer.router.gate.weight[:2] += 0.5 * layer.router.gate.weight[:2].sign()
    model = nn.Sequential(layer)

    def load_cv(x: torch.Tensor) -> float:
        _, routing = layer.route(layer.router(x))
        load = routing.load
        return float(load.std(unbiased=False) / load.mean())

    probe = torch.randn(512, 12).abs()
    start = load_cv(probe)
    for _ in range(100):
        with torch.no_grad():
            layer(torch.randn(4, 16, 12).abs())
        update_expert_biases(model, None)
    assert start > 0.8 and load_cv(probe) < start / 3, (start, load_cv(probe))


def test_bias_stays_fp32_in_a_half_model():
    layer = MoELayer(MoEConfig(expert_count=4, router_bias_update_rate=1e-3), FFNSpec(8, 16)).half()
    assert layer.expert_bias.dtype == torch.float32 and layer.experts.fc1_weight.dtype == torch.float16
    assert layer.expert_load.dtype == torch.long


@pytest.mark.parametrize("fields,message", [
    (dict(expert_count=16, top_k=9), "--moe-top-k 9 is not supported: use 1 to 8"),
    (dict(expert_count=4, top_k=3, second_expert_policy="sampling"), "applies to top-2 only"),
    (dict(expert_count=4, expert_ffn_dim=-1), "--moe-expert-ffn-dim -1 is negative"),
    (dict(expert_count=4, shared_expert_count=-2), "--moe-shared-expert-count -2 is negative"),
    (dict(expert_count=4, router_bias_update_rate=-0.1), "--moe-router-bias-update-rate -0.1 is negative"),
    (dict(expert_count=4, top_k=1, router="expert_choice", router_bias_update_rate=1e-3), "experts choose tokens"),
    (dict(expert_count=4, second_expert_policy="sampling", router_bias_update_rate=1e-3), "ignores the bias"),
    (dict(expert_count=4, capacity_factor=-1.0), "--moe-capacity-factor -1.0 is negative"),
])
def test_bad_routing_options_are_one_line_errors(fields, message):
    with pytest.raises(TsConfigError, match=message) as err:
        check_moe_config(MoEConfig(**fields))
    assert "\n" not in str(err.value)
