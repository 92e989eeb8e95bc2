"""One ``fairseq-train`` run in this process, timed over a window of updates and with one update
profiled: where a training step's device time goes.

    python benchmarks/train_profile.py --time 10:30 --profile 31 --out run.json -- DATA --arch ts_lm_large ...

Everything after ``--`` is ``fairseq-train``'s command line (``--max-update`` is set to one past
the profiled update). ``fairseq.trainer.Trainer.train_step`` is wrapped: the device is
synchronised before the window's first update and after its last (no other sync is added),
so ``tokens/s`` = window tokens / window seconds; then update ``--profile`` runs under
``torch.profiler`` with ``torch.cuda.set_sync_debug_mode("warn")``, and its trace is summarised
by :func:`summarise` into the issue's rows:

- ``gemm``: matrix-product kernels; ``attention``: fused attention kernels;
- ``loss``: kernels launched by the criterion's loss (its forward and its backward nodes);
- ``optimizer``: kernels launched inside fairseq's ``optimizer``, ``clip-grads``,
  ``multiply-grads`` and ``reduce-grads`` ranges (gradient norm, clipping, Adam);
- ``copies``: memcpy/memset and the kernels of ``copy_``, ``to``, ``cat``, ``contiguous``;
- ``norms_elementwise``: every other kernel (LayerNorms, GELU, dropout, residual adds, ...);
- ``idle``: step time not covered by any kernel (launch gaps, host work, host syncs);
- ``host_syncs``: ``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / ``cudaEventSynchronize``
  calls in the step, and where each came from (the first frame in fairseq or this plugin);
- ``busy_ms``: the step's time covered by kernels; ``host_ms``: the step's time outside those sync
  calls (the host's work for the update; a sync of the autograd engine's thread counts as a wait too,
  as the step's thread waits for it in ``backward``), and ``host_ranges_ms``, the same per fairseq
  range (``forward``, ``backward``, ``optimizer``, ...).

The profiled update starts on an idle device and ends with a sync, so its idle row also holds
host work that a run without syncs overlaps with the previous update's kernels. What a run
overlaps is read from the window: ``ms_per_update`` (window seconds / updates) and
``between_steps_ms`` (the host's time per update outside fairseq's ``Trainer.train_step``: fairseq's
loop, the data iterator, logging, and what the plugin's trainer does around fairseq's step, such as
moving the expert biases). A step is device-bound where ``busy_ms`` is close to ``ms_per_update``,
host-bound where ``host_ms + between_steps_ms`` is.

What the window holds beyond its mean, ``window_detail`` (:class:`WindowWatch`), says why a window
is slower than its profiled update: each update's host interval (start to next start; a one-off
cost shows as one long interval), compilations in the window (dynamo's counters), the CUDA caching
allocator's ``cudaMalloc`` / ``cudaFree`` calls and retries in the window (a retry frees cached
blocks, which synchronises the device) and its peaks, and the cyclic garbage collector's time.

With ``--host-profile N`` the ``N`` updates after the window run under ``cProfile`` (before the
profiled update): ``host_profile`` lists the Python functions where the host's time per update
goes (own time and with callees), which says what a host-bound step spends its time on (on a GPU
the launches, guards and wrappers around the kernels). ``cProfile`` slows Python-heavy code, so
these updates are kept out of the window.

The JSON written to ``--out`` holds the window's tokens/s, the per-update token count, the
profile's rows (ms and share of the step), the 15 longest kernels, ``window_detail``,
``host_profile`` and ``compile_fallbacks`` (over the whole run: graph breaks, functions dynamo left eager,
and the reasons; :mod:`torchscale_fairseq.architecture.compile_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

GEMM = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|_mm_|splitk", re.I)
ATTENTION = re.compile(r"flash|fmha|attention|sdpa|mha", re.I)
COPY_OPS = re.compile(r"^aten::(copy_|to|_to_copy|cat|contiguous|clone|stack|index_select)$")
LOSS_OPS = re.compile(r"log_softmax|nll_loss|cross_entropy|LogSoftmaxBackward|NllLossBackward|_LinearCrossEntropy"
                      r"|ts_loss")
OPTIMIZER_RANGES = ("optimizer", "clip-grads", "multiply-grads", "reduce-grads")
HOST_RANGES = ("forward", "backward", *OPTIMIZER_RANGES)  # fairseq's record_function ranges of a step
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
ROWS = ("gemm", "attention", "norms_elementwise", "loss", "optimizer", "copies", "idle")
STEP_RANGE = "ts_profiled_step"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarise(trace: dict) -> dict[str, Any]:
    """The rows of one profiled step from a chrome trace (``prof.export_chrome_trace``): device
    time per category, idle time, host syncs and the longest kernels (times in ms)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    step = next(e for e in events if e.get("name") == STEP_RANGE and e.get("cat") == "user_annotation")
    lo, hi = step["ts"], step["ts"] + step["dur"]
    ops_by_tid: dict[Any, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and lo <= e["ts"] <= hi:
            ops_by_tid[e["tid"]].append(e)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}

    def enclosing(launch: dict) -> list[str]:
        t = launch["ts"]
        return [o["name"] for o in ops_by_tid.get(launch["tid"], []) if o["ts"] <= t <= o["ts"] + o["dur"]]

    rows: dict[str, float] = Counter()
    busy, kernels = [], Counter()
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start, end = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if end <= start:
            continue
        busy.append((start, end))
        ms = (end - start) / 1e3
        kernels[e["name"][:120]] += ms
        launch = launches.get(e.get("args", {}).get("correlation"))
        names = enclosing(launch) if launch is not None else []
        if any(n in OPTIMIZER_RANGES for n in names):
            row = "optimizer"
        elif any(LOSS_OPS.search(n) for n in names):
            row = "loss"
        elif e["cat"] != "kernel" or any(COPY_OPS.match(n) for n in names[-1:]):
            row = "copies"
        elif GEMM.search(e["name"]):
            row = "gemm"
        elif ATTENTION.search(e["name"]):
            row = "attention"
        else:
            row = "norms_elementwise"
        rows[row] += ms
    step_ms = (hi - lo) / 1e3
    busy_ms = union_length(busy) / 1e3
    rows["idle"] = step_ms - busy_ms
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and e["name"] in SYNC_CALLS and lo <= e["ts"] <= hi]
    waits = [(e["ts"], e["ts"] + e["dur"]) for e in syncs]  # also the autograd thread's, which backward waits for

    def host_ms(start: float, end: float) -> float:
        """Wall time of [start, end] less the sync calls' waits inside it (of any thread: the step's thread
        waits for the autograd engine's through ``backward``)."""
        waited = union_length([(max(s, start), min(e, end)) for s, e in waits if min(e, end) > max(s, start)])
        return (end - start - waited) / 1e3

    ranges: dict[str, float] = Counter()
    for e in ops_by_tid.get(step["tid"], []):
        if e.get("cat") == "user_annotation" and e["name"] in HOST_RANGES:
            ranges[e["name"]] += host_ms(e["ts"], e["ts"] + e["dur"])
    return {
        "step_ms": step_ms,
        "rows_ms": {r: rows.get(r, 0.0) for r in ROWS},
        "rows_share": {r: rows.get(r, 0.0) / step_ms for r in ROWS},
        "host_syncs": max(len(syncs) - 1, 0),  # the last one is the profiler's own, closing the step
        "busy_ms": busy_ms,
        "host_ms": host_ms(lo, hi),
        "host_ranges_ms": {r: ranges.get(r, 0.0) for r in HOST_RANGES},
        "top_kernels": [{"name": n, "ms": ms} for n, ms in kernels.most_common(15)],
    }


REPO_PREFIX = str(Path(__file__).resolve().parents[1]) + "/"


def _short_path(filename: str) -> str:
    """``filename`` relative to site-packages or to the repository."""
    return filename.split("site-packages/")[-1].removeprefix(REPO_PREFIX)


def _sync_site() -> str:
    """The innermost frame of fairseq or this plugin on the current stack."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/fairseq/" in frame.filename or "/torchscale_fairseq/" in frame.filename:
            return f"{_short_path(frame.filename)}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def sync_sites(cuda: bool):
    """Where the code syncs the host with the device (``set_sync_debug_mode``'s warnings)."""
    sites: Counter = Counter()
    if not cuda:
        yield sites
        return
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[_sync_site()] += 1
        else:
            previous(message, category, filename, lineno, file, line)

    torch.cuda.set_sync_debug_mode("warn")
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            yield sites
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = previous


ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
# dynamo's frames compiled, graphs made and AOTAutograd compilations (a recompile in the window shows in each)
COMPILE_COUNTERS = {"frames": ("frames", "total"), "graphs": ("stats", "unique_graphs"),
                    "aot_autograd": ("aot_autograd", "total")}


def _compile_counts() -> dict[str, float]:
    from torch._dynamo.utils import counters

    return {name: float(counters[group][key]) for name, (group, key) in COMPILE_COUNTERS.items()}


class WindowWatch:
    """What happens inside the timed window besides the updates' own work: per-update host intervals,
    compilations, the caching allocator's device calls and the garbage collector's pauses."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.starts: list[float] = []
        self.gc_ms, self.gc_runs, self._gc_start = 0.0, 0, 0.0
        self.on = False
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_ms += 1e3 * (time.perf_counter() - self._gc_start)
            self.gc_runs += 1

    def _allocator(self) -> dict[str, float]:
        stats = torch.cuda.memory_stats() if self.cuda else {}
        return {k: float(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}

    def start(self) -> None:
        self.on = True
        self.compiles, self.alloc = _compile_counts(), self._allocator()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()  # the window's peaks, not the warm-up's

    def update_started(self) -> None:
        self.starts.append(time.perf_counter())

    def stop(self) -> dict[str, Any]:
        self.on = False
        gc.callbacks.remove(self._gc)
        compiles, alloc = _compile_counts(), self._allocator()
        stats = torch.cuda.memory_stats() if self.cuda else {}
        intervals = [1e3 * (b - a) for a, b in zip(self.starts, self.starts[1:])]
        return {
            "intervals_ms": [round(x, 2) for x in intervals],
            "compilations": {k: compiles[k] - self.compiles[k] for k in COMPILE_COUNTERS},
            "allocator": {k: alloc[k] - self.alloc[k] for k in ALLOCATOR_COUNTS},
            "peak_allocated_gb": stats.get("allocated_bytes.all.peak", 0) / 2**30,
            "peak_reserved_gb": stats.get("reserved_bytes.all.peak", 0) / 2**30,
            "gc_ms": self.gc_ms,
            "gc_runs": self.gc_runs,
        }


def host_functions(stats: Any, updates: int, key: str, top: int = 25) -> list[dict[str, Any]]:
    """The ``top`` functions of a ``pstats.Stats`` by own time (``key`` "tottime") or with callees
    ("cumtime"), in ms and calls per update."""
    rows = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        seconds = tottime if key == "tottime" else cumtime
        rows.append({"function": f"{_short_path(filename)}:{line}({name})", "ms": 1e3 * seconds / updates,
                     "calls": calls / updates})
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def wrap_train_step(first: int, last: int, profile_at: int, out: Path, tokens_per_update: int,
                    host_profile: int = 0) -> None:
    """Time updates ``first``..``last`` (update k is the one that starts with ``get_num_updates() ==
    k - 1``), each with the loop after it: the window runs from update ``first``'s start to update
    ``last + 1``'s, the device synchronised at both ends only; profile update ``profile_at`` (after
    the window); write ``out``."""
    from fairseq.trainer import Trainer

    original = Trainer.train_step
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    marks: dict[str, float] = {}
    result: dict[str, Any] = {"tokens_per_update": tokens_per_update, "window": [first, last]}
    watch = WindowWatch(cuda)
    host = {"profiler": None, "seconds": 0.0}  # --host-profile: the updates after the window under cProfile

    def train_step(self, samples, raise_oom=False):
        update = self.get_num_updates() + 1
        if update == first:
            sync()
            marks["start"], marks["outside"] = time.perf_counter(), 0.0
            watch.start()
        elif first < update <= last + 1:
            marks["outside"] += time.perf_counter() - marks["returned"]
        if first <= update <= last + 1:
            watch.update_started()
        if update == last + 1:
            sync()
            seconds, updates = time.perf_counter() - marks["start"], last - first + 1
            result["window_detail"] = watch.stop()
            result["window_seconds"] = seconds
            result["tokens_per_s"] = tokens_per_update * updates / seconds
            result["ms_per_update"] = 1e3 * seconds / updates
            result["between_steps_ms"] = 1e3 * marks["outside"] / updates
        if update != profile_at:
            profiled = last < update <= last + host_profile
            if profiled:
                import cProfile

                host["profiler"] = host["profiler"] or cProfile.Profile()
                start = time.perf_counter()
                host["profiler"].enable()
            output = original(self, samples, raise_oom)
            if profiled:
                host["profiler"].disable()
                host["seconds"] += time.perf_counter() - start
                if update == last + host_profile:
                    import pstats

                    stats = pstats.Stats(host["profiler"])
                    result["host_profile"] = {
                        "updates": host_profile, "ms_per_update": 1e3 * host["seconds"] / host_profile,
                        "top_tottime": host_functions(stats, host_profile, "tottime"),
                        "top_cumtime": host_functions(stats, host_profile, "cumtime"),
                    }
            marks["returned"] = time.perf_counter()
        else:
            from torch.profiler import ProfilerActivity, profile, record_function

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            sync()
            with sync_sites(cuda) as sites, profile(activities=activities) as prof:
                with record_function(STEP_RANGE):
                    output = original(self, samples, raise_oom)
                    sync()
            trace_path = out.with_suffix(".trace.json")
            prof.export_chrome_trace(str(trace_path))
            result["profile"] = summarise(json.loads(trace_path.read_text()))  # on a CPU: host times only
            result["sync_sites"] = dict(sites.most_common())
            trace_path.unlink()
        if update == profile_at:
            from torchscale_fairseq.architecture.compile_report import compile_fallbacks  # the plugin fairseq loaded

            result["compile_fallbacks"] = compile_fallbacks()  # what torch.compile could not compile whole
            out.write_text(json.dumps(result, indent=1))
        return output

    Trainer.train_step = train_step


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: train_profile.py --time A:B --profile K --tokens N --out FILE -- FAIRSEQ_TRAIN_ARGS")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--time", required=True, help="first:last update of the timed window")
    p.add_argument("--profile", type=int, required=True, help="the update to profile (after the window)")
    p.add_argument("--tokens", type=int, required=True, help="tokens per update (batch x sequence)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--host-profile", type=int, default=0,
                   help="run this many updates after the window under cProfile (before the profiled one)")
    args = p.parse_args(argv[:split])
    first, last = (int(x) for x in args.time.split(":"))
    if not (1 <= first <= last and args.host_profile >= 0 and last + args.host_profile < args.profile):
        raise SystemExit(f"--time {args.time} --host-profile {args.host_profile} --profile {args.profile}: need "
                         "1 <= first <= last and last + host-profile < profile")
    wrap_train_step(first, last, args.profile, args.out, args.tokens, args.host_profile)
    from fairseq_cli import train

    sys.argv = ["fairseq-train", *argv[split + 1:], "--max-update", str(args.profile)]
    train.cli_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
