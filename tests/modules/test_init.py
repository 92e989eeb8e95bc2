"""Initialisation: measured std of the scaled weights equals the backbone's gain times
Xavier-normal's std, q/k untouched, residual alpha applied (formulas written out here,
independently of torchscale_fairseq.modules.backbone)."""

import math

import pytest
import torch

from tests.helpers.model_utils import build

D, FFN = 128, 512
XAVIER_SQ = math.sqrt(2.0 / (D + D))
XAVIER_FFN = math.sqrt(2.0 / (D + FFN))


def expected(backbone: str, part: str, n: int, m: int):
    """(alpha, gain) from the tables of DeepNet and Magneto (REFERENCE.md)."""
    if backbone in ("preln", "postln"):
        return 1.0, 1.0
    if backbone == "deepnorm":
        if part == "only":
            return (2 * n) ** 0.25, (8 * n) ** -0.25
        if part == "enc":
            return 0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)
        return (3 * m) ** 0.25, (12 * m) ** -0.25
    if part == "only":
        return 1.0, math.sqrt(math.log(2 * n))
    if part == "enc":
        return 1.0, math.sqrt(math.log(3 * m) * math.log(2 * n) / 3)
    return 1.0, math.sqrt(math.log(3 * m))


def check_layer(layer, alpha: float, gain: float, cross: bool = False) -> None:
    assert layer.alpha == pytest.approx(alpha, rel=1e-9)
    attns = [(layer.self_attn, layer.self_attn.qkv_proj.weight.chunk(3, dim=0))]
    if cross:
        q = layer.cross_attn.q_proj.weight
        k, v = layer.cross_attn.kv_proj.weight.chunk(2, dim=0)
        attns.append((layer.cross_attn, (q, k, v)))
    for attn, (q, k, v) in attns:
        assert q.std().item() == pytest.approx(XAVIER_SQ, rel=0.03)
        assert k.std().item() == pytest.approx(XAVIER_SQ, rel=0.03)
        assert v.std().item() == pytest.approx(gain * XAVIER_SQ, rel=0.03)
        assert attn.out_proj.weight.std().item() == pytest.approx(gain * XAVIER_SQ, rel=0.03)
    assert layer.ffn.fc1.weight.std().item() == pytest.approx(gain * XAVIER_FFN, rel=0.03)
    assert layer.ffn.fc2.weight.std().item() == pytest.approx(gain * XAVIER_FFN, rel=0.03)


SIZES = dict(decoder_embed_dim=D, encoder_embed_dim=D, decoder_ffn_embed_dim=FFN, encoder_ffn_embed_dim=FFN)


@pytest.mark.parametrize("backbone", ["magneto", "deepnorm", "preln", "postln"])
@pytest.mark.parametrize("depth", [1, 6, 24])
def test_decoder_only_and_encoder_only_gains(backbone, depth):
    torch.manual_seed(0)
    alpha, gain = expected(backbone, "only", depth, depth)
    lm = build("lm", backbone=backbone, decoder_layers=depth, **SIZES)
    mlm = build("mlm", backbone=backbone, encoder_layers=depth, **SIZES)
    last = str(depth - 1)  # layers are keyed by their global index
    for layer in (lm.decoder.layers["0"], lm.decoder.layers[last], mlm.encoder.encoder.layers[last]):
        check_layer(layer, alpha, gain)


@pytest.mark.parametrize("backbone", ["magneto", "deepnorm"])
@pytest.mark.parametrize("n,m", [(6, 6), (12, 6), (2, 18)])
def test_encoder_decoder_gains(backbone, n, m):
    torch.manual_seed(0)
    model = build("mt", backbone=backbone, encoder_layers=n, decoder_layers=m, **SIZES)
    check_layer(model.encoder.layers["0"], *expected(backbone, "enc", n, m))
    check_layer(model.decoder.layers[str(m - 1)], *expected(backbone, "dec", n, m), cross=True)


def test_deepnorm_residual_is_scaled_by_alpha():
    """A DeepNorm layer computes LN(alpha * x + f(x)) for both sublayers."""
    torch.manual_seed(0)
    layer = build("lm", backbone="deepnorm", decoder_layers=4).decoder.layers["0"].eval()
    alpha = (2 * 4) ** 0.25
    x = torch.randn(2, 5, 64)
    h = layer.self_attn_layer_norm(alpha * x + layer.self_attn(x, causal=True))
    reference = layer.final_layer_norm(alpha * h + layer.ffn(h))
    torch.testing.assert_close(layer(x, causal=True)[0], reference, rtol=1e-5, atol=1e-5)


def test_magneto_has_inner_layernorms_and_preln_does_not():
    mag = build("mt", backbone="magneto")
    pre = build("mt", backbone="preln")
    layer = mag.decoder.layers["0"]
    assert layer.self_attn.inner_attn_ln is not None and layer.cross_attn.inner_attn_ln is not None
    assert layer.ffn.ffn_layernorm is not None
    assert pre.decoder.layers["0"].self_attn.inner_attn_ln is None and pre.decoder.layers["0"].ffn.ffn_layernorm is None
