"""``benchmarks/train_profile.py``'s trace summary against a step worked out by hand: kernels
fall in the rows by name and by the range or op that launched them, idle time is the step not
covered by any kernel (overlaps counted once), the profiler's closing sync is not a host sync, and
the host's time is the step less its thread's waits; and its timed window on a clock the test moves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

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


def test_host_time_is_the_step_less_its_waits():
    """``host_ms``: the step's 10 ms less the 1 ms the forward waited in a sync, the 2 ms the autograd
    thread waited in one during backward (the step's thread waits for it there) and the 3 ms of the
    closing sync; per range, each range's own waits."""
    sync = {"ph": "X", "cat": "cuda_runtime", "args": {}}
    events = [
        op(STEP_RANGE, 0, 10_000, cat="user_annotation"),
        op("forward", 100, 3000, cat="user_annotation"),
        {**sync, "name": "cudaStreamSynchronize", "ts": 2000, "dur": 1000, "tid": 1},
        op("backward", 3100, 3000, cat="user_annotation"),
        {**sync, "name": "cudaStreamSynchronize", "ts": 4000, "dur": 2000, "tid": 2},
        op("optimizer", 6100, 500, cat="user_annotation"),
        *kernel("fused_adamw_kernel", 6500, 500, 6200, 1),
        {**sync, "name": "cudaDeviceSynchronize", "ts": 7000, "dur": 3000, "tid": 1},
    ]
    got = summarise({"traceEvents": events})
    assert got["host_ms"] == pytest.approx(4.0)
    assert got["host_ranges_ms"]["forward"] == pytest.approx(2.0)
    assert got["host_ranges_ms"]["backward"] == pytest.approx(1.0)
    assert got["host_ranges_ms"]["optimizer"] == pytest.approx(0.5)
    assert got["host_ranges_ms"]["clip-grads"] == 0.0
    assert got["busy_ms"] == pytest.approx(0.5)
    assert got["host_syncs"] == 2  # the closing sync is the profiler's


def test_the_window_splits_time_per_update_into_the_step_and_the_loop_around_it(tmp_path, monkeypatch):
    """Updates 1-3 timed on a clock the test moves: 10 ms in each ``train_step`` (50 ms in update 2,
    which also runs one garbage collection and compiles a function) and 25 ms of the trainer's loop after it, so 145 ms in
    the window of which 25 per update between steps, and the window's detail names update 2 as the
    slow one; update 4 is profiled (no CUDA here: its sync sites only) and closes the window; the graph
    break of a function it compiles is counted with its reason."""
    import gc
    import json

    import fairseq.trainer
    import train_profile

    clock = {"now": 0.0}
    monkeypatch.setattr(train_profile.time, "perf_counter", lambda: clock["now"])

    class Trainer:
        updates = 0

        def get_num_updates(self):
            return self.updates

        def train_step(self, samples, raise_oom=False):
            clock["now"] += 0.010 if self.updates != 1 else 0.050
            if self.updates == 1:
                gc.collect()
                torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))  # one frame, one graph
            if self.updates == 3:  # the profiled update compiles a function that breaks its graph once
                torch.compile(broken, backend="eager")(torch.ones(2))
            self.updates += 1

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    monkeypatch.setattr(fairseq.trainer, "Trainer", Trainer)
    out = tmp_path / "run.json"
    torch._dynamo.utils.counters.clear()
    train_profile.wrap_train_step(1, 3, 4, out, tokens_per_update=300)
    trainer = Trainer()
    for _ in range(4):
        trainer.train_step(None)
        clock["now"] += 0.025
    got = json.loads(out.read_text())
    assert got["ms_per_update"] == pytest.approx(145.0 / 3)
    assert got["between_steps_ms"] == pytest.approx(25.0)
    assert got["tokens_per_s"] == pytest.approx(900 / 0.145)
    assert got["window"] == [1, 3] and got["sync_sites"] == {}
    detail = got["window_detail"]
    assert detail["intervals_ms"] == pytest.approx([35.0, 75.0, 35.0])
    assert detail["gc_runs"] >= 1  # update 2's collection (and any the interpreter ran meanwhile)
    assert detail["compilations"] == {"frames": 1.0, "graphs": 1.0, "aot_autograd": 0.0}  # eager backend: no AOT
    assert set(detail["allocator"].values()) == {0.0}
    assert train_profile.WindowWatch._gc not in [getattr(c, "__func__", None) for c in gc.callbacks]
    fallbacks = got["compile_fallbacks"]
    assert fallbacks["graph_breaks"] == 1 and fallbacks["frames_run_eager"] == 0, fallbacks
    assert list(fallbacks["reasons"].values()) == [1] and "graph_break" in next(iter(fallbacks["reasons"]))
    torch._dynamo.utils.counters.clear()


def test_a_real_cpu_run_finds_fairseqs_ranges_in_the_profiled_step(lm_data, tmp_path):
    """The whole script on a tiny ``ts_lm`` (CPU): the profiler's trace has fairseq's ``forward``,
    ``backward`` and ``optimizer`` ranges on the step's thread (the names :data:`HOST_RANGES` reads),
    with no kernels the host's time is the whole step, and the window's figures are consistent."""
    import json

    from tests.helpers.cli_utils import USER_DIR, run

    out = tmp_path / "run.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "train_profile.py"
    run([sys.executable, str(script), "--time", "2:3", "--profile", "4", "--tokens", "64", "--out", str(out), "--",
         str(lm_data), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm", "--decoder-layers", "1",
         "--decoder-embed-dim", "32", "--decoder-attention-heads", "2", "--decoder-ffn-embed-dim", "64",
         "--tokens-per-sample", "32", "--sample-break-mode", "none", "--batch-size", "2", "--optimizer", "adam",
         "--lr", "1e-3", "--cpu", "--disable-validation", "--no-save", "--save-dir", str(tmp_path / "ckpt"),
         "--num-workers", "0", "--seed", "1"], cwd=tmp_path)
    got = json.loads(out.read_text())
    prof = got["profile"]
    assert prof["busy_ms"] == 0.0 and prof["host_ms"] == pytest.approx(prof["step_ms"])
    ranges = prof["host_ranges_ms"]
    assert all(ranges[k] > 0 for k in ("forward", "backward", "optimizer"))
    assert sum(ranges.values()) <= prof["host_ms"]
    assert got["ms_per_update"] == pytest.approx(got["window_seconds"] * 1e3 / 2)
    assert 0 < got["between_steps_ms"] < got["ms_per_update"]


def test_the_updates_after_the_window_show_where_the_hosts_time_goes(tmp_path, monkeypatch):
    """``host_profile`` (updates 3-4 here, after the window 1-2 and before the profiled update 5):
    the functions the step called, per update, with the slowest first."""
    import json

    import fairseq.trainer
    import train_profile

    def slow_host_work():
        return sum(i * i for i in range(200_000))

    def fast_host_work():
        return 0

    class Trainer:
        updates = 0

        def get_num_updates(self):
            return self.updates

        def train_step(self, samples, raise_oom=False):
            slow_host_work()
            fast_host_work()
            fast_host_work()
            self.updates += 1

    monkeypatch.setattr(fairseq.trainer, "Trainer", Trainer)
    out = tmp_path / "run.json"
    train_profile.wrap_train_step(1, 2, 5, out, tokens_per_update=10, host_profile=2)
    trainer = Trainer()
    for _ in range(5):
        trainer.train_step(None)
    host = json.loads(out.read_text())["host_profile"]
    assert host["updates"] == 2 and host["ms_per_update"] > 0
    by_name = {f["function"].rsplit("(", 1)[1].rstrip(")"): f for f in host["top_cumtime"]}
    assert by_name["slow_host_work"]["calls"] == 1.0 and by_name["fast_host_work"]["calls"] == 2.0
    assert by_name["slow_host_work"]["ms"] > by_name["fast_host_work"]["ms"]
    assert [f["ms"] for f in host["top_tottime"]] == sorted((f["ms"] for f in host["top_tottime"]), reverse=True)
