"""Balance loss ``E * sum_e f_e p_e`` against hand-computed values; padding excluded."""

from __future__ import annotations

import pytest
import torch

from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.balance import balance_loss
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.layer import MoELayer


def test_uniform_routing_gives_one():
    probs = torch.full((8, 4), 0.25)
    first = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    assert float(balance_loss(probs, first)) == pytest.approx(1.0)


def test_hand_computed_value():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.5, 0.4, 0.1]])
    first = probs.argmax(-1)
    f = [3 / 4, 0.0, 1 / 4]
    p = [(0.7 + 0.6 + 0.1 + 0.5) / 4, (0.2 + 0.3 + 0.1 + 0.4) / 4, (0.1 + 0.1 + 0.8 + 0.1) / 4]
    expected = 3 * sum(a * b for a, b in zip(f, p))
    assert float(balance_loss(probs, first)) == pytest.approx(expected)


def test_all_tokens_to_one_expert_gives_e_times_p():
    probs = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 5)
    assert float(balance_loss(probs, probs.argmax(-1))) == pytest.approx(4.0)


def test_gradient_flows_through_probabilities_only():
    logits = torch.randn(6, 3, requires_grad=True)
    probs = torch.softmax(logits, -1)
    balance_loss(probs, probs.argmax(-1)).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("router", ["xmoe", "linear"])
def test_padding_excluded_from_loss_stats_and_output(router):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(expert_count=4, top_k=2, router=router, capacity_factor=0.0,
                               second_expert_policy="all"), FFNSpec(8, 16))
    real = torch.randn(1, 5, 8)
    padded = torch.cat([real, torch.randn(1, 3, 8) * 10], dim=1)
    mask = torch.tensor([[False] * 5 + [True] * 3])
    y_real, aux_real = layer(real)
    loss_real, stats_real = float(aux_real.balance_loss), aux_real.stats
    y_pad, aux_pad = layer(padded, mask)
    assert float(aux_pad.balance_loss) == pytest.approx(loss_real, abs=1e-6)
    assert aux_pad.stats.tokens == stats_real.tokens == 5
    assert torch.allclose(y_pad[:, :5], y_real, atol=1e-6)
    assert torch.equal(y_pad[:, 5:], torch.zeros_like(y_pad[:, 5:]))
    probs = torch.softmax(layer.router(real.reshape(-1, 8)), -1)
    assert float(aux_pad.balance_loss) == pytest.approx(float(balance_loss(probs, probs.argmax(-1))), abs=1e-6)


@pytest.mark.parametrize("top_k", [1, 2])
def test_padding_takes_no_capacity_slot(top_k):
    """With a binding capacity (factor 1.25, some assignments dropped) a padded batch routes its
    real tokens as the same tokens without the padding would: padding, left or right, takes no
    expert slot and no share of the capacity."""
    torch.manual_seed(0)  # a draw where both top-1 and top-2 drop assignments
    layer = MoELayer(MoEConfig(expert_count=4, top_k=top_k, router="xmoe", capacity_factor=1.25,
                               second_expert_policy="all"), FFNSpec(8, 16))
    x = torch.randn(3, 12, 8)
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0, :4] = True  # left padding (a fairseq source)
    mask[1, 9:] = True  # right padding (a target)
    x[mask] = torch.randn(int(mask.sum()), 8) * 10
    y_pad, aux_pad = layer(x, mask)
    y_real, aux_real = layer(x[~mask].unsqueeze(0))
    assert int(aux_real.stats.dropped) > 0  # the capacity binds
    assert int(aux_pad.stats.dropped) == int(aux_real.stats.dropped)
    assert int(aux_pad.stats.routed) == int(aux_real.stats.routed)  # no slot given to padding
    assert int(aux_pad.stats.tokens) == int(aux_real.stats.tokens) == int((~mask).sum())
    assert float(aux_pad.balance_loss) == pytest.approx(float(aux_real.balance_loss), abs=1e-6)
    assert torch.allclose(y_pad[~mask], y_real[0], atol=1e-6)
    assert torch.equal(y_pad[mask], torch.zeros_like(y_pad[mask]))


@pytest.mark.parametrize("padded", [False, True])
def test_routing_entropy_sums_the_real_tokens(padded):
    """``routing_stats``' entropy sum against ``-sum_t sum_e p log p`` in float64 over the real tokens
    (one flat sum, so that no compiled reduction fuses a per-token sum with the z-loss's: Triton 3.6)."""
    from torchscale_fairseq.modules.moe.balance import routing_stats
    from torchscale_fairseq.modules.moe.gating import top_k_routing

    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(40, 6, generator=g) * 3, dim=-1)
    probs[3, 0] = 0.0  # a zero probability counts 0, not nan
    real = (torch.arange(40) % 7 != 0) if padded else None
    stats = routing_stats(probs, top_k_routing(probs, 2, 0.0, "all", False, True, None, real))
    p = probs.double()
    per_token = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    want = per_token.sum() if real is None else per_token[real].sum()
    assert float(stats.entropy_sum) == pytest.approx(float(want), rel=1e-6)
    assert int(stats.tokens) == (40 if real is None else int(real.sum()))
