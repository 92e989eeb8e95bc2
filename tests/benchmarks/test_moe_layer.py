"""``benchmarks/moe_layer.py --kernel-profile``'s table against a profiled run worked out by hand: each kernel
falls in its row by name (torch._grouped_mm's CUTLASS kernels, cuBLAS GEMMs, sorts / top-k / scans, index /
scatter / gather kernels, copies, the rest), counted once, and device-busy time counts overlaps once. The roofline
floor against its formula: ``6 T k`` FLOPs per expert weight, and 3 passes over the experts' weights. The twins
``--compiled-routing`` and ``--compiled-experts`` ask for."""

from __future__ import annotations

import pytest
import torch

from benchmarks._common import datasheet_hbm
from benchmarks.moe_layer import (
    COPIES,
    EXPERTS,
    OTHER_KERNELS,
    ROUTED,
    expert_floor_ms,
    kernel_rows,
    print_floor_table,
    twin_suffixes,
)
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.layer import MoELayer

GROUPED = ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal"
           "<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cutlass::gemm::collective::CollectiveMma")


def kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7}


def test_kernels_fall_in_their_rows_and_overlaps_count_once():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::_grouped_mm", "ts": 0, "dur": 50, "tid": 1},  # host: not counted
        kernel(GROUPED, 0, 400), kernel(GROUPED, 1000, 600),
        kernel("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 2000, 300),
        kernel("void at::native::sbtopk::gatherTopK<c10::BFloat16, unsigned int, 2, false>(...)", 2500, 40),
        kernel("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>", 2600, 30),
        kernel("void at::native::tensor_kernel_scan_innermost_dim<long, std::plus<long> >(...)", 2700, 10),
        kernel("void at::native::indexFuncLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>(...)", 2800, 20),
        kernel("triton_poi_fused_index_put_new_zeros_3", 2900, 15),
        kernel("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
               "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}", 3000, 25),
        kernel("Memcpy HtoD (Pageable -> Device)", 3100, 5, cat="gpu_memcpy"),
        kernel("triton_red_fused__to_copy_mul_sum_7", 3200, 50),
        kernel("triton_poi_fused_gelu_backward_1", 3220, 50),  # overlaps the one before by 30 us
    ]}
    got = kernel_rows(trace)
    rows = {label: (pytest.approx(ms), count) for label, (ms, count) in got["rows"].items()}
    assert rows == {"grouped GEMM": (1.0, 2), "GEMM": (0.3, 1), "sort, top-k, scan": (0.08, 3),
                    "index, scatter, gather": (0.035, 2), COPIES: (0.03, 2), OTHER_KERNELS: (0.1, 2)}
    assert got["kernels"] == 12
    assert got["busy_ms"] == pytest.approx(1.0 + 0.3 + 0.08 + 0.035 + 0.03 + 0.1 - 0.03)


def test_floor_is_the_flops_and_three_passes_over_the_expert_weights(capsys):
    experts, dim, ffn, tokens = 8, 64, 256, 1000
    layer = MoELayer(MoEConfig(expert_count=experts, top_k=2, capacity_factor=1.0), FFNSpec(dim, ffn)).to(torch.bfloat16)
    compute, memory = expert_floor_ms(layer.experts, tokens, 2, hbm=4.8e12)
    assert compute == pytest.approx(3 * 2 * tokens * 2 * (dim * ffn + ffn * dim) / 989e12 * 1e3)
    weight_bytes = experts * 2 * dim * ffn * 2  # bf16
    assert memory == pytest.approx(3 * weight_bytes / 4.8e12 * 1e3)
    print_floor_table({(experts, "grouped"): layer}, [experts], "grouped", tokens, 2, 4.8e12, "dense",
                      max(compute, memory) / 2)
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"| {experts} | {weight_bytes / 1e9:.3g} | {compute:.3g} | {memory:.3g} | 2.00 |")


def test_floor_needs_a_listed_device():
    assert datasheet_hbm("cpu") is None


@pytest.mark.parametrize("routing,experts,mode,twins", [
    ("off", "off", "grouped", []),
    ("on", "on", "grouped", []),  # "on" sets the flag on every layer: no twin
    ("both", "off", "loop", [ROUTED]),
    ("off", "both", "grouped", [EXPERTS]),
    ("off", "both", "loop", []),  # the compiled experts take the fused path of grouped GEMMs only
    ("both", "both", "grouped", [ROUTED, EXPERTS, ROUTED + EXPERTS]),
    ("both", "both", "loop", [ROUTED]),
])
def test_twins_are_the_compiled_variants_asked_for(routing, experts, mode, twins):
    assert twin_suffixes(routing, experts, mode) == twins
