"""The grouped experts and the expert-parallel regrouping against independent references:
per-token loops through each expert's weights with plain autograd, and brute-force orders."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.experts import GradBuffers, GroupedLinear, _probe_grouped_mm, grouped_mm_fits
from torchscale_fairseq.modules.moe.layer import MoELayer, sender_to_expert_order


def _cpu_grouped_mm() -> bool:
    """Whether this torch runs ``torch._grouped_mm`` on the CPU (2.13 does)."""
    try:
        torch._grouped_mm(torch.ones(4, 4), torch.ones(1, 4, 4), offs=torch.tensor([4], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


# the grouped path, forced, wherever this torch runs torch._grouped_mm on the CPU (2.13 does)
GROUPED = [False, True] if _cpu_grouped_mm() else [False]


def _reference_output(layer: MoELayer, tokens: torch.Tensor) -> torch.Tensor:
    """``sum_a gate_a * FFN_{e_a}(x_{t_a})`` token by token, from the layer's own parameters."""
    ex = layer.experts
    _, r = layer.route(layer.router(tokens))
    out = torch.zeros_like(tokens)
    for t, e, g in zip(r.token.tolist(), r.expert.tolist(), r.gate):
        h = F.gelu(tokens[t] @ ex.fc1_weight[e] + ex.fc1_bias[e])
        if ex.ln_weight is not None:
            h = F.layer_norm(h, h.shape[-1:], ex.ln_weight[e], ex.ln_bias[e], eps=ex.layernorm_eps)
        out = out.index_add(0, torch.tensor([t]), (g * (h @ ex.fc2_weight[e] + ex.fc2_bias[e])).unsqueeze(0))
    return out


def _grads(layer: MoELayer, x: torch.Tensor, weight: torch.Tensor, forward) -> list[torch.Tensor]:
    params = [x] + list(layer.parameters())
    return list(torch.autograd.grad((forward(x) * weight).sum(), params, allow_unused=True))


@pytest.mark.parametrize("grouped", GROUPED)
@pytest.mark.parametrize("subln", [False, True])
@pytest.mark.parametrize("experts,tokens", [(4, 24), (8, 3)])
def test_gradients_equal_per_token_reference(subln, experts, tokens, grouped):
    """Every gradient (input, router, each expert's weights, biases and Sub-LN), including
    experts that get no token (``(8, 3)``: at most 6 of 8 experts are used); the expert GEMMs
    one per expert and as ``torch._grouped_mm`` (forced here; by default only on Hopper GPUs)."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(expert_count=experts, top_k=2, capacity_factor=1.0, second_expert_policy="all"),
                     FFNSpec(8, 16, subln=subln))
    layer.experts.grouped_mm = grouped
    x = torch.randn(tokens, 8, requires_grad=True)
    weight = torch.randn(tokens, 8)
    ours = _grads(layer, x, weight, lambda t: layer(t.unsqueeze(0))[0].squeeze(0))
    ref = _grads(layer, x, weight, lambda t: _reference_output(layer, t))
    for a, b in zip(ours, ref):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0
        else:
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("counts", [[5, 0, 7, 3], [9]])
def test_grouped_gemm_equals_the_loop(counts, with_bias):
    """``GroupedLinear`` as ``torch._grouped_mm`` calls equals one GEMM per expert (fp32, 1e-6 relative) in
    its output and every gradient, with an expert without rows, without bias (the split ``fc2``), and at
    E = 1 (a dense layer)."""
    torch.manual_seed(3)
    x, w, b = torch.randn(sum(counts), 8), torch.randn(len(counts), 8, 12), torch.randn(len(counts), 12)
    assert not grouped_mm_fits(x, w), "on the CPU the experts run one GEMM per expert by default"
    if not _cpu_grouped_mm():  # this torch cannot run the grouped path on the CPU: the default above is all there is
        return
    grad = torch.randn(sum(counts), 12)
    results = []
    for grouped in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        out = GroupedLinear.apply(leaves[0], leaves[1], leaves[2] if with_bias else None, counts, GradBuffers(),
                                  "fc", grouped)
        results.append([out, *torch.autograd.grad(out, leaves[:3] if with_bias else leaves[:2], grad)])
    for loop, grouped in zip(*results):
        assert torch.allclose(grouped, loop, rtol=1e-6, atol=1e-6), (grouped - loop).abs().max()
    if len(counts) == 1:
        assert torch.allclose(results[1][0], x @ w[0] + (b[0] if with_bias else 0), rtol=1e-6, atol=1e-6)


def assert_bf16_expert_gemms_near_float64(device: str, grouped: bool) -> None:
    """In bf16 the output and every gradient are within bf16 rounding of a float64 reference from the
    same operands (relative norm < 1e-2), with groups of 1,200 and 800 rows and one without: the bias
    gradient must sum each group's rows in fp32 (a bf16 running sum, as CUDA's atomic ``index_add_``
    makes, is about 3% off here)."""
    torch.manual_seed(4)
    counts = [1200, 0, 800]
    x, w, b = torch.randn(sum(counts), 64), torch.randn(3, 64, 32) / 8, torch.randn(3, 32)
    grad = torch.randn(sum(counts), 32, device=device, dtype=torch.bfloat16)
    leaves = [t.to(device, torch.bfloat16).requires_grad_() for t in (x, w, b)]
    out = GroupedLinear.apply(*leaves, counts, GradBuffers(), "fc", grouped)
    ours = [out, *torch.autograd.grad(out, leaves, grad)]
    x64, w64, b64, g64 = (t.detach().cpu().double() for t in (*leaves, grad))  # exact products
    expert = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
    ref = [torch.einsum("nd,ndf->nf", x64, w64[expert]) + b64[expert],
           torch.einsum("nf,ndf->nd", g64, w64[expert]),
           torch.stack([x64[expert == e].t() @ g64[expert == e] for e in range(3)]),
           torch.stack([g64[expert == e].sum(0) for e in range(3)])]
    for name, a, r in zip(("out", "dx", "dw", "db"), ours, ref):
        assert a.dtype == torch.bfloat16 and a.device.type == device, name
        assert ((a.cpu().double() - r).norm() / r.norm()).item() < 1e-2, name


@pytest.mark.parametrize("grouped", GROUPED)
def test_bf16_expert_gemms_near_float64(grouped):
    """:func:`assert_bf16_expert_gemms_near_float64` on the CPU; with the grouped path, the probe that
    decides for the grouped GEMM on a GPU accepts it at the layer's feature sizes."""
    assert_bf16_expert_gemms_near_float64("cpu", grouped)
    if grouped:
        assert _probe_grouped_mm(torch.device("cpu"), 512, 2048)


@pytest.mark.parametrize("grouped", GROUPED)
def test_expert_gemms_ignore_the_rows_after_the_groups(grouped):
    """Rows after the groups (dropped and padding assignments): a sum's expanded gradient is taken, and a NaN gradient
    on those rows reaches no result: their input gradient is zero, the others are float64's from the grouped rows."""
    torch.manual_seed(5)
    counts = [30, 0, 20]
    x = torch.randn(60, 16, requires_grad=True)  # 10 rows after the groups
    w = (torch.randn(3, 16, 8) / 4).requires_grad_()
    b = torch.randn(3, 8, requires_grad=True)
    run = (lambda: GroupedLinear.apply(x, w, b, counts, GradBuffers(), "fc", True)) if grouped else (
        lambda: torch.cat([GroupedLinear.apply(x[:50], w, b, counts, GradBuffers(), "fc", False), x.new_zeros(10, 8)]))
    run().sum().backward()  # the gradient of a sum comes expanded
    grad = torch.randn(60, 8)
    grad[50:] = float("nan")
    for upstream in (torch.ones(60, 8), grad):
        dx, dw, db = torch.autograd.grad(run(), (x, w, b), upstream)
        expert = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
        g64, x64, w64 = upstream[:50].double(), x[:50].detach().double(), w.detach().double()
        assert torch.equal(dx[50:], torch.zeros(10, 16))
        for ours, ref in ((dx[:50], torch.einsum("nf,ndf->nd", g64, w64[expert])),
                          (dw, torch.stack([x64[expert == e].t() @ g64[expert == e] for e in range(3)])),
                          (db, torch.stack([g64[expert == e].sum(0) for e in range(3)]))):
            assert torch.allclose(ours.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad[:50].double(), torch.einsum("nf,ndf->nd", torch.ones(50, 8).double(),
                                                             w.detach().double()[expert]), rtol=1e-5, atol=1e-5)


def test_weight_gradients_across_steps_none_and_accumulated():
    """Step 2 after ``.grad = None`` reuses the weight-gradient memory; step 3 without
    clearing must accumulate. Both against the reference's gradients."""
    torch.manual_seed(1)
    layer = MoELayer(MoEConfig(expert_count=4, top_k=2, capacity_factor=1.0, second_expert_policy="all"), FFNSpec(8, 16))
    expert_params = list(layer.experts.parameters())
    xs = [torch.randn(16, 8) for _ in range(3)]
    refs = [torch.autograd.grad(_reference_output(layer, x).sum(), expert_params) for x in xs]
    for step, x in enumerate(xs):
        if step < 2:
            layer.zero_grad(set_to_none=True)
        layer(x.unsqueeze(0))[0].sum().backward()
        expected = refs[step] if step < 2 else [a + b for a, b in zip(refs[1], refs[2])]
        for p, g in zip(expert_params, expected):
            assert torch.allclose(p.grad, g, atol=1e-5), (step, (p.grad - g).abs().max())


@pytest.mark.parametrize("counts", [[[2, 0, 1], [3, 1, 0]], [[0, 0], [0, 4]], [[1], [2], [0], [5]]])
def test_sender_to_expert_order_is_brute_force_regrouping(counts):
    counts = torch.tensor(counts)
    labels = [(s, e) for s in range(counts.size(0)) for e in range(counts.size(1)) for _ in range(int(counts[s, e]))]
    wanted = sorted(range(len(labels)), key=lambda i: (labels[i][1], labels[i][0], i))
    assert sender_to_expert_order(counts).tolist() == wanted
