"""``benchmarks/train_profile.py``'s trace summary against a step worked out by hand: kernels
fall in the rows by name and by the range or op that launched them, idle time is the step not
covered by any kernel (overlaps counted once), and the profiler's closing sync is not a host sync."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from train_profile import STEP_RANGE, summarise  # noqa: E402


def op(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def kernel(name: str, ts: float, dur: float, launched_at: float, correlation: int, tid: int = 1) -> list[dict]:
    launch = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launched_at, "dur": 1, "tid": tid,
              "args": {"correlation": correlation}}
    return [launch, {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7,
                     "args": {"correlation": correlation}}]


def test_rows_idle_and_syncs_of_a_hand_made_step():
    events = [
        op(STEP_RANGE, 0, 10_000, cat="user_annotation"),
        op("aten::mm", 100, 50), *kernel("sm90_xmma_gemm_bf16", 1000, 2000, 120, 1),
        op("aten::_flash_attention_forward", 200, 50), *kernel("flash_fwd_kernel", 3000, 1000, 210, 2),
        op("aten::layer_norm", 300, 50), *kernel("vectorized_layer_norm_kernel", 3500, 1000, 310, 3),  # overlaps
        op("aten::log_softmax", 400, 50), *kernel("cunn_SoftMaxForward", 5000, 500, 410, 4),
        op("aten::copy_", 500, 50), *kernel("elementwise_kernel", 5500, 500, 510, 5),
        op("optimizer", 600, 300, cat="user_annotation"), op("aten::_fused_adamw_", 650, 50),
        *kernel("fused_adamw_kernel", 7000, 1000, 660, 6),
        op("autograd::engine::evaluate_function: MmBackward0", 700, 50, tid=2),
        *kernel("nvjet_tst_gemm", 8000, 1000, 710, 7, tid=2),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 9000, "dur": 500, "tid": 7, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 950, "dur": 5, "tid": 1, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 9900, "dur": 5, "tid": 1, "args": {}},
        *kernel("outside_the_step", 20_000, 1000, 900, 8),
    ]
    got = summarise({"traceEvents": events})
    ms = got["rows_ms"]
    assert got["step_ms"] == 10.0
    assert ms["gemm"] == pytest.approx(3.0)  # forward GEMM 2 ms and its backward 1 ms
    assert ms["attention"] == pytest.approx(1.0)
    assert ms["norms_elementwise"] == pytest.approx(1.0)
    assert ms["loss"] == pytest.approx(0.5)
    assert ms["copies"] == pytest.approx(1.0)  # the copy_ kernel and the memcpy
    assert ms["optimizer"] == pytest.approx(1.0)
    # busy: [1, 4.5] + [5, 6] + [7, 9.5] = 7 ms of the 10 (the LayerNorm overlaps the attention)
    assert ms["idle"] == pytest.approx(3.0)
    assert got["host_syncs"] == 1
    assert got["top_kernels"][0] == {"name": "sm90_xmma_gemm_bf16", "ms": 2.0}
