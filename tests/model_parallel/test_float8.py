"""``--fp8``: which linear layers convert (torchao's size rules on the local shard), the FP8 GEMMs
against a fake-quantised reference written from the recipe's formula (torchao's emulated path on
the CPU), and the one-line refusals (CPU, GPU without FP8, no torchao, MoE)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import model_utils
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.float8 import (
    Float8Gemm,
    convert_to_fp8,
    fp8_linears,
    fp8_refusal,
    fp8_shape_rule,
)
from torchscale_fairseq.model_parallel.layers import ColumnParallelLinear, RowParallelLinear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("recipe, n, k, converts", [
    ("tensorwise", 1024, 1024, False),   # K <= 4096 and N <= 1024
    ("tensorwise", 3072, 1024, True),
    ("tensorwise", 1024, 4096, False),
    ("tensorwise", 1024, 4112, True),
    ("tensorwise", 4104, 1024, False),   # N not a multiple of 16
    ("rowwise", 2048, 8192, False),      # N <= 2048
    ("rowwise", 8192, 1024, False),      # K <= 1024
    ("rowwise", 4096, 2048, False),      # N <= 4096 and K <= 2048
    ("rowwise", 4096, 2064, True),
    ("rowwise", 6144, 2048, True),
])
def test_shape_rule_is_torchaos_auto_filter(recipe, n, k, converts):
    assert fp8_shape_rule(recipe, n, k) is converts
    from torchao.float8 import _auto_filter_for_recipe

    assert _auto_filter_for_recipe(recipe, [])(torch.nn.Linear(k, n, device="meta"), "layer") is converts


@pytest.mark.parametrize("recipe, expected", [
    ("tensorwise", ["self_attn.qkv_proj", "self_attn.out_proj", "ffn.fc1", "ffn.fc2"]),
    ("rowwise", ["self_attn.qkv_proj", "ffn.fc1"]),  # out_proj 2048 x 2048 and fc2 2048 x 8192: N <= 2048
])
def test_which_layers_of_a_1p3b_layer_convert(recipe, expected):
    """One layer of the 1.3B benchmark model (width 2048, FFN 8192): its four linears by the rules;
    the output layer (the tied embedding) is not a linear module and never converts."""
    model = model_utils.build("lm", decoder_embed_dim=2048, decoder_ffn_embed_dim=8192, decoder_layers=1,
                              decoder_attention_heads=16)
    assert [n for n, _ in fp8_linears(model)] == [f"decoder.layers.0.{n}" for n in
                                                  ("self_attn.qkv_proj", "self_attn.out_proj", "ffn.fc1", "ffn.fc2")]
    converted = convert_to_fp8(model, recipe, emulate=True)
    assert converted == [f"decoder.layers.0.{n}" for n in expected]
    gemms = {n: m.gemm for n, m in fp8_linears(model)}
    assert all(isinstance(gemms[n], Float8Gemm) == (n in converted) for n in gemms)


def fake_fp8(t: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> torch.Tensor:
    """``t`` cast to ``dtype`` with the dynamic scale ``s = max(dtype) / amax`` (over all of ``t``,
    or along ``dim`` per slice; rounded down to a power of two if ``pow2``), saturated, and cast back."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (fmax / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def fp8_linear_reference(x, w, b, grad_y, recipe):
    """``y = Q(x) Q(W)^T + b``, ``dx = Q(dy) Q(W)``, ``dW = Q(dy)^T Q(x)``, ``db = sum dy``, each GEMM
    operand quantised for its own GEMM: tensorwise e4m3 operands and an e5m2 gradient; rowwise e4m3
    throughout, scaled per slice along the GEMM's contraction dimension, power-of-two scales."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])
    rowwise = recipe == "rowwise"
    go_dtype = E4M3 if rowwise else E5M2

    def q(t, dtype, dim):
        return fake_fp8(t, dtype, dim if rowwise else None, rowwise)

    y = q(x2, E4M3, -1) @ q(w, E4M3, -1).t() + b
    dx = q(g2, go_dtype, -1) @ q(w, E4M3, 0)
    dw = q(g2, go_dtype, 0).t() @ q(x2, E4M3, 0)
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw, g2.sum(0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_fp8_linear_equals_the_fake_quantised_reference(recipe, kind):
    torch.manual_seed(0)
    layer = (ColumnParallelLinear(64, 48) if kind == "column" else RowParallelLinear(64, 48))
    convert_to_fp8(layer, recipe, module_filter=lambda name, m: True, emulate=True)
    x = (torch.randn(3, 5, 64) * torch.logspace(-2, 1, 64)).requires_grad_()  # columns of unlike magnitude
    with torch.no_grad():
        layer.bias.normal_()
    grad_y = torch.randn(3, 5, 48) * torch.logspace(1, -3, 48)
    y = layer(x)
    y.backward(grad_y)
    ry, rdx, rdw, rdb = fp8_linear_reference(x.detach(), layer.weight.detach(), layer.bias.detach(), grad_y, recipe)
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, rdx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, rdw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, rdb, rtol=1e-5, atol=1e-6)
    # and FP8 is not the identity: the full-precision GEMM differs by more than rounding
    assert (y - F.linear(x, layer.weight, layer.bias)).abs().max() > 1e-3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_lm_loss_and_gradients_near_full_precision(recipe):
    """A whole ts_lm with every linear converted: the loss within 2% of full precision's, every
    gradient within 20% in norm (e5m2 gradients keep 2 mantissa bits), and not equal (the GEMMs did run in FP8)."""
    torch.manual_seed(0)
    model = model_utils.build("lm", decoder_embed_dim=64, decoder_ffn_embed_dim=128)
    fp8 = copy.deepcopy(model)
    assert len(convert_to_fp8(fp8, recipe, module_filter=lambda name, m: True, emulate=True)) == 8
    tokens = torch.randint(4, 40, (4, 32))
    losses, grads = [], []
    for m in (model, fp8):
        logits, _ = m(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert losses[0] != losses[1]
    assert abs(losses[1] - losses[0]) < 0.02 * losses[0]
    for name, g in grads[0].items():
        assert (grads[1][name] - g).norm() <= 0.2 * g.norm() + 1e-6, name


def test_refusals_name_the_device():
    assert "not the CPU" in fp8_refusal("cpu", None)
    assert "this GPU has 8.0" in fp8_refusal("cuda", (8, 0))
    assert fp8_refusal("cuda", (8, 9)) is None and fp8_refusal("cuda", (9, 0)) is None
    with pytest.raises(TsConfigError, match="not the CPU"):  # this machine has no GPU
        model_utils.build("lm", fp8="tensorwise")


def test_refusal_without_torchao_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(TsConfigError, match=r"pip install torchao==0\.17\.0") as err:
        convert_to_fp8(model_utils.build("lm"), "tensorwise", emulate=True)
    assert "\n" not in str(err.value)


def test_refusals_of_recipe_and_expert_gemms():
    with pytest.raises(TsConfigError, match="not a recipe"):
        convert_to_fp8(model_utils.build("lm"), "blockwise")
    with pytest.raises(TsConfigError, match="does not run expert GEMMs"):
        model_utils.build("lm", fp8="rowwise", moe_expert_count=4, moe_freq=2)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fairseq_train_config_builds_torchaos_recipe(lm_data, monkeypatch, recipe):
    """``--fp8`` as fairseq-train hands it to the model (its typed config holds the choice as an enum
    member, not a string) gives every converted layer torchao's config of that recipe. The CPU refusal is lifted:
    on a GPU the same path builds the model (2026-11-30, H200: torchao said "unknown recipe_name")."""
    import torchscale_fairseq.models.config as model_config
    from tests.helpers.cli_utils import USER_DIR

    monkeypatch.setattr(model_config, "fp8_refusal", lambda device_type, capability: None)
    _, model = model_utils.fairseq_train_model([
        str(lm_data), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_tiny", "--cpu",
        "--decoder-embed-dim", "1152", "--decoder-ffn-embed-dim", "8192", "--tokens-per-sample", "16", "--fp8", recipe,
    ])
    from torchao.float8 import Float8LinearConfig

    gemms = [m.gemm for _, m in fp8_linears(model) if isinstance(m.gemm, Float8Gemm)]
    assert gemms and all(g.config == Float8LinearConfig.from_recipe_name(recipe) for g in gemms)
