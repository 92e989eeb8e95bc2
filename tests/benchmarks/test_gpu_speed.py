"""``benchmarks/gpu_speed.py``'s JSON lines: the issue's metric names hold our fastest path (the fast path,
or the same with ``--ts-cuda-graphs`` where that run is faster), each path also under its own suffix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_speed  # noqa: E402

FLOPS = 1e9  # per token


def run(tokens_per_s: float, command: str) -> dict:
    return {"tokens_per_s": tokens_per_s, "flops_per_token": FLOPS, "command": command}


def record_in_order(tmp_path, graphs_tokens_per_s: float) -> dict[str, list[dict]]:
    """The plan's order for ``ts_lm_large``: fast, stock, fast with graphs; each metric's lines."""
    path = tmp_path / "results.jsonl"
    runs: dict = {}
    plan = [("large_fast", "", run(100.0, "fast")), ("stock", None, run(80.0, "stock")),
            ("large_fast_cuda_graphs", gpu_speed.GRAPHS, run(graphs_tokens_per_s, "graphs"))]
    for name, suffix, result in plan:
        runs[name] = result
        gpu_speed.record(name, "ts_lm_large", suffix, result, runs, peak=2e15, path=path, device="cpu")
    lines: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        lines.setdefault(row["metric"], []).append(row)
    return lines


def test_a_faster_run_with_graphs_becomes_the_issues_metric(tmp_path):
    lines = record_in_order(tmp_path, graphs_tokens_per_s=150.0)
    mfu = lines["mfu_datasheet_ts_lm_large"]
    assert [r["command"] for r in mfu] == ["fast", "graphs"]  # the last line: the fastest path
    assert mfu[-1]["value"] == pytest.approx(150.0 * FLOPS / gpu_speed.DATASHEET_BF16, abs=1e-4)
    assert mfu[-1]["target"] == gpu_speed.TARGETS["mfu_datasheet_ts_lm_large"]
    assert lines["mfu_measured_ts_lm_large"][-1]["value"] == pytest.approx(150.0 * FLOPS / 2e15, abs=1e-4)
    assert [r["value"] for r in lines["tokens_per_s_vs_stock"]] == [1.25, 1.875]
    assert [r["value"] for r in lines["tokens_per_s_vs_stock_cuda_graphs"]] == [1.875]
    assert len(lines["mfu_datasheet_ts_lm_large_cuda_graphs"]) == 1


def test_a_slower_run_with_graphs_keeps_its_own_names(tmp_path):
    lines = record_in_order(tmp_path, graphs_tokens_per_s=90.0)
    assert [r["command"] for r in lines["mfu_datasheet_ts_lm_large"]] == ["fast"]
    assert [r["value"] for r in lines["tokens_per_s_vs_stock"]] == [1.25]
    assert [r["value"] for r in lines["tokens_per_s_vs_stock_cuda_graphs"]] == [1.125]


def test_host_costs_time_each_step_per_call():
    """The CPU's code path (CUDA adds the launch call and a graph replay): each step timed, per call, in µs."""
    costs = gpu_speed.host_costs("cpu", calls=50, compile_backend="aot_eager")
    assert set(costs) == {"op", "linear_fwd_bwd", "compiled_call"}
    assert all(0 < v < 1e5 for v in costs.values()), costs


def test_the_runs_a_target_reads_come_before_those_none_reads(monkeypatch):
    """A bench-speed cut by its time limit loses the last runs: on a GPU with FP8 the order is the fast path
    and stock, the fast path with CUDA graphs, FP8 tensorwise, then the default path and FP8 rowwise; each
    config's runs keep the configs' order."""
    monkeypatch.setattr(gpu_speed, "fp8_unavailable", lambda device: None)
    names = [run[0] for run in gpu_speed.run_plan(gpu_speed.CONFIGS, "cuda")]
    assert names == ["large_fast", "stock", "1p3b_fast", "large_fast_cuda_graphs", "1p3b_fast_cuda_graphs",
                     "1p3b_fp8", "large_base", "1p3b_fp8rw"]
    assert [run[0] for run in gpu_speed.run_plan(gpu_speed.CONFIGS, "cpu")] == [
        "large_fast", "stock", "1p3b_fast", "1p3b_fp8", "large_base", "1p3b_fp8rw"]


def test_the_fused_master_step_joins_the_fast_runs_only(monkeypatch):
    """The fast path's flags (with ``--ts-fused-master-step`` once its GPU check passed) reach the fast, graphed and
    FP8 runs, not the default path nor stock fairseq; on the CPU the check is not run and says why."""
    monkeypatch.setattr(gpu_speed, "fp8_unavailable", lambda device: None)
    fast = gpu_speed.FAST + [gpu_speed.FUSED_MASTER_STEP]
    flags = {name: args for name, _, args, _, _ in gpu_speed.run_plan(gpu_speed.CONFIGS, "cuda", fast)}
    with_it = {name for name, args in flags.items() if gpu_speed.FUSED_MASTER_STEP in args}
    assert with_it == {"large_fast", "1p3b_fast", "large_fast_cuda_graphs", "1p3b_fast_cuda_graphs", "1p3b_fp8",
                       "1p3b_fp8rw"}
    assert gpu_speed.FUSED_MASTER_STEP not in gpu_speed.FAST  # the plan's own copy, the module's list unchanged
    assert gpu_speed.fused_master_step_unchecked("cpu") == "it runs on a CUDA device"


def test_the_fused_master_step_check_names_a_gpu_test():
    path, name = gpu_speed.MASTER_STEP_CHECK.split("::")
    source = (Path(gpu_speed.REPO) / path).read_text()
    assert f"def {name}(" in source and "pytestmark = pytest.mark.gpu" in source
