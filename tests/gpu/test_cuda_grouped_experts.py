"""The experts' grouped GEMM (``torch._grouped_mm``) on a Hopper GPU in bf16: chosen by default for
the layer's sizes, and equal to one GEMM per expert (bf16 rounding) in the output and every gradient."""

from __future__ import annotations

import pytest
import torch

from tests.modules.moe.test_experts import assert_bf16_expert_gemms_near_float64
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.experts import GradBuffers, GroupedLinear, grouped_mm_fits
from torchscale_fairseq.modules.moe.layer import MoELayer

pytestmark = pytest.mark.gpu


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_grouped_mm_is_chosen_on_hopper_and_equals_the_loop():
    """Chosen exactly on compute capability >= 9.0 (torch._grouped_mm's CUTLASS kernels); there, equal to the loop,
    and its gradients (the bias's a grouped GEMM, no atomic adds) bitwise the same on a second run."""
    torch.manual_seed(0)
    counts = [300, 0, 700, 24]
    x = torch.randn(sum(counts), 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(counts), 512, 2048, device="cuda", dtype=torch.bfloat16) / 512**0.5
    b = torch.randn(len(counts), 2048, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_fits(x, w) == HOPPER
    if not HOPPER:  # elsewhere the loop runs, which the CPU tests check against the per-token reference
        return
    grad = torch.randn(sum(counts), 2048, device="cuda", dtype=torch.bfloat16)
    results = []
    for grouped in (False, True, True):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        out = GroupedLinear.apply(*leaves, counts, GradBuffers(), "fc", grouped)
        results.append([out, *torch.autograd.grad(out, leaves, grad)])
    for loop, grouped, again in zip(*results):
        assert torch.allclose(grouped.float(), loop.float(), rtol=2e-2, atol=2e-2 * loop.float().abs().max().item())
        assert torch.equal(grouped, again)


@pytest.mark.parametrize("grouped", [False, True] if HOPPER else [False])
def test_bf16_expert_gemms_on_cuda_near_float64(grouped):
    """Both paths on CUDA within bf16 rounding of float64 (the bias gradient summed in fp32, not by
    bf16 atomics)."""
    assert_bf16_expert_gemms_near_float64("cuda", grouped)


def test_moe_layer_trains_with_grouped_experts_in_bf16():
    """The layer's default (grouped on Hopper, the loop elsewhere) against the loop forced."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(expert_count=16, top_k=2, capacity_factor=1.0, second_expert_policy="all"),
                     FFNSpec(512, 2048)).to("cuda", torch.bfloat16)
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    outs = {}
    for grouped in (False, None):  # None: the layer's own choice
        layer.experts.grouped_mm = grouped
        layer.zero_grad(set_to_none=True)
        y = layer(x)[0]
        y.float().pow(2).mean().backward()
        outs[grouped] = (y.float(), layer.experts.fc1_weight.grad.float())
    assert torch.allclose(outs[None][0], outs[False][0], rtol=2e-2, atol=2e-2)
    assert torch.allclose(outs[None][1], outs[False][1], rtol=5e-2, atol=5e-2 * outs[False][1].abs().max().item())


def test_fused_dispatch_equals_the_reference_on_cuda():
    """The fused dispatch (gather inside fc1, combine inside fc2) against the step-by-step path on the
    device, in bf16 with grouped GEMMs where they run: output and every gradient within bf16 rounding."""
    import copy

    torch.manual_seed(0)
    cfg = MoEConfig(expert_count=16, top_k=2, capacity_factor=1.0, second_expert_policy="all")
    reference = MoELayer(cfg, FFNSpec(256, 512)).cuda().to(torch.bfloat16).train()
    reference.experts.grouped_mm = HOPPER
    reference.fused_dispatch = False
    fused = copy.deepcopy(reference)
    fused.fused_dispatch = True
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    results = []
    for layer in (reference, fused):
        tokens = x.clone().requires_grad_()
        out, _ = layer(tokens)
        (out * weight).float().sum().backward()
        results.append([out, tokens.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        scale = a.float().abs().max().item()
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * scale)


def test_compiled_fused_layer_equals_eager_on_cuda():
    """The fused layer compiled (inductor, as ``--ts-compile`` runs it) against itself eager on the device:
    output and every gradient within bf16 rounding (on torch 2.11 an in-place combine output once gave
    every gradient through the compiled layer as zero; ``tests/architecture/test_ts_compile.py`` checks the
    same on the CPU with ``aot_eager``)."""
    import copy

    torch.manual_seed(0)
    cfg = MoEConfig(expert_count=16, top_k=2, capacity_factor=1.0, second_expert_policy="all")
    eager = MoELayer(cfg, FFNSpec(256, 512)).cuda().to(torch.bfloat16).train()
    eager.experts.grouped_mm = HOPPER
    compiled = copy.deepcopy(eager)
    run_compiled = torch.compile(compiled)
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    results = []
    for layer, forward in ((eager, eager), (compiled, run_compiled)):
        tokens = x.clone().requires_grad_()
        out, aux = forward(tokens)
        ((out * weight).float().sum() + aux.balance_loss).backward()
        results.append([out, tokens.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        scale = a.float().abs().max().item()
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("padded,parts", [(False, "routing"), (True, "routing"), (True, "experts"),
                                          (False, "routing+experts")])
def test_compiled_moe_parts_equal_the_eager_layer_on_cuda(padded, parts):
    """``--moe-compiled-routing on`` (inductor's Triton kernels for the router, top-k, slots, gates, dispatch
    rows, losses and statistics) and ``--moe-compiled-experts on`` (the gather, grouped GEMMs, biases,
    activation, Sub-LN and combine) against the same layer run eagerly on the device, policy ``all``
    (inductor draws its own random numbers): the same routing (loads, drops), the output, the losses and
    every gradient within bf16 rounding (``tests/modules/moe/test_compiled_routing.py`` and
    ``test_compiled_experts.py`` check the graphs and their numerics on the CPU)."""
    import copy

    torch.manual_seed(0)
    cfg = MoEConfig(expert_count=16, top_k=2, capacity_factor=1.0, second_expert_policy="all")
    eager = MoELayer(cfg, FFNSpec(256, 512, subln=True)).cuda().to(torch.bfloat16).train()
    eager.experts.grouped_mm = HOPPER
    compiled = copy.deepcopy(eager)
    compiled.compiled_routing = "routing" in parts
    compiled.compiled_experts = "experts" in parts
    # on Hopper the flag's path runs: the fused path (elsewhere one GEMM per expert, eagerly)
    assert compiled._why_not_fused(torch.empty(1, 256, device="cuda", dtype=torch.bfloat16)) is None or not HOPPER
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16)
    padding = (torch.arange(256, device="cuda") >= 200).expand(4, 256).clone() if padded else None
    weight = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    results = []
    for layer in (eager, compiled):
        tokens = x.clone().requires_grad_()
        out, aux = layer(tokens, padding)
        ((out * weight).float().sum() + aux.balance_loss + aux.z_loss).backward()
        stats = aux.stats
        results.append([stats.dropped, stats.routed, stats.tokens, out, aux.balance_loss, aux.z_loss, stats.load_cv,
                        tokens.grad] + [p.grad for p in layer.parameters()])
    for i, (a, b) in enumerate(zip(*results)):
        if i < 3:  # counts: the same routing
            assert torch.equal(a, b), (i, a, b)
            continue
        scale = a.float().abs().max().item()
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * scale), i
