"""Issue 43's speed table on one GPU, in one call: MFU of ``ts_lm_large`` (16 x 2048 tokens per
update) and a 1.3B model (8 x 2048) as users train them (sequence 2048, GPT-2's 50,257-token
vocabulary, bf16), the plugin's fast path ("fast": ``--ts-fused-cross-entropy --ts-compile --optimizer
ts_adamw --ts-sync-free-step``, and ``--ts-fused-master-step`` where its kernel passes its GPU check first),
the fast path with ``--ts-cuda-graphs`` (metrics ``*_cuda_graphs``) and, for
``ts_lm_large``, its default path ("baseline"), tokens/s of the fast path against stock fairseq
``transformer_lm`` of the same size on the same data, a profile of one update of every run (``train_profile.py``: where the time
goes), and the micro-benchmarks that choose the next changes (the host's cost per launch, SDPA kernels,
the output GEMM's width), and the 1.3B fast path with ``--fp8 tensorwise`` / ``rowwise`` (torchao's float8 training;
``fp8_gain_1p3b`` = its tokens/s over the bf16 fast path's; run where the GPU has FP8 and torchao
imports). Each figure becomes one JSON line (``--results``) with the issue's metric names, which hold our
fastest path: the fast path's figures, appended again from the run with ``--ts-cuda-graphs`` where that
one is faster (:func:`record`).

    python benchmarks/gpu_speed.py --results $OUT/gpu_results.jsonl --log-dir $OUT   # on the node
    python benchmarks/gpu_speed.py --toy --results /tmp/r.jsonl                      # the code path on CPU

MFU = tokens/s x FLOPs per token (``mfu.flops_per_token``: 6 x parameters of the matrix products
plus 12 L T d for attention) over the datasheet dense bf16 rate (989 TFLOP/s for the H100 SXM and
the H200) and over the 8192^3 bf16 GEMM rate measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import (
    DATASHEET_BF16,
    KERNEL_LAUNCH_CALLS,
    REPO,
    USER_DIR,
    append_results,
    decoder_dim_flags,
    device_line,
    git_commit,
    make_words,
    now,
    tool,
    write_lm_corpus,
)
from mfu import flops_per_token, gemm_flops_per_s

GPT2_VOCAB = 50257
SEQ = 2048
CONFIGS = {  # name: (layers width heads FFN, sequences per update)
    "ts_lm_large": ("12 1024 16 4096", 16),
    "1p3b": ("24 2048 16 8192", 8),
}
FAST = ["--ts-fused-cross-entropy", "--ts-compile", "--optimizer", "ts_adamw", "--ts-sync-free-step"]
FUSED_MASTER_STEP = "--ts-fused-master-step"  # joins the fast path on a GPU where its kernel passes its check
MASTER_STEP_CHECK = ("tests/gpu/test_cuda_fused_master_step.py::"
                     "test_fused_master_step_on_cuda_equals_torchs_fused_adamw_on_the_copies")
GRAPHS = "_cuda_graphs"  # the fast path with --ts-cuda-graphs: run name and metric suffix
TARGETS = {"mfu_datasheet_ts_lm_large": 0.45, "mfu_datasheet_1p3b": 0.52, "tokens_per_s_vs_stock": 1.5,
           "fp8_gain_1p3b": 1.2}
FP8_RUNS = {"1p3b_fp8": "tensorwise", "1p3b_fp8rw": "rowwise"}  # run name: --fp8 recipe, beside 1p3b_fast
WINDOW, HOST_PROFILE, PROFILE = (11, 30), 3, 34  # timed updates, updates under cProfile, the profiled one
DEFAULT_DATA = REPO / "outputs" / "gpu_speed_data" / "data-bin"


def gpt2_sized_data(work: Path, train_tokens: int, vocab: int) -> Path:
    """Zipf text over ``vocab`` pseudo-words binarised with a dictionary of all of them (GPT-2's
    size: 50,257 words, the full stop and fairseq's 4 symbols, padded to a multiple of 8 as
    fairseq-preprocess pads: 50,264 entries, as fairseq's GPT-2 dictionary)."""
    dest = work / "data-bin"
    if (dest / "train.bin").exists():
        return dest
    text = write_lm_corpus(work / "text", vocab, train_tokens)
    words = make_words(vocab, random.Random(1)) + ["."]  # write_lm_corpus's words, in its order
    words += [f"madeupword{i:04d}" for i in range(-(len(words) + 4) % 8)]  # as fairseq's --padding-factor 8
    (work / "dict.txt").write_text("".join(f"{w} 1\n" for w in words))
    subprocess.run([tool("fairseq-preprocess"), "--only-source", "--srcdict", str(work / "dict.txt"),
                    "--trainpref", str(text["train"]), "--validpref", str(text["valid"]), "--destdir", str(dest),
                    "--workers", str(min(16, os.cpu_count() or 1))], check=True, capture_output=True)
    return dest


def train_args(data: Path, arch_flags: list[str], batch: int, toy: bool) -> list[str]:
    """fairseq-train's arguments; ``arch_flags`` last, so that they override the defaults before them."""
    device = ["--cpu"] if toy else ["--bf16"]
    return [str(data), "--task", "language_modeling", "--tokens-per-sample", str(SEQ if not toy else 64),
            "--sample-break-mode", "none", "--share-decoder-input-output-embed", "--dropout", "0.1",
            *device, "--lr", "5e-4", "--batch-size", str(batch), "--log-format", "json", "--log-interval", "100",
            "--disable-validation", "--no-save", "--seed", "1", "--num-workers", "2", *arch_flags]


def run_profiled(name: str, args: list[str], tokens: int, window: tuple[int, int], host_profile: int, profile: int,
                 log_dir: Path, timeout: int) -> dict | None:
    out = log_dir / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).with_name("train_profile.py")), "--time", f"{window[0]}:{window[1]}",
           "--host-profile", str(host_profile), "--profile", str(profile), "--tokens", str(tokens),
           "--out", str(out), "--", *args,
           "--save-dir", str(log_dir / "checkpoints")]  # fairseq creates it even under --no-save
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        failed = proc.returncode != 0
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        failed, tail = True, f"TIMEOUT after {timeout} s\n" + str(e.stdout or "")[-2000:]
    (log_dir / f"{name}.log").write_text(" ".join(cmd) + "\n" + tail)
    if failed or not out.exists():
        print(f"[{name}] FAILED in {time.time() - start:.0f} s:\n{tail[-1500:]}", flush=True)
        return None
    result = json.loads(out.read_text())
    result["command"] = "fairseq-train DATA " + " ".join(args[1:])
    result["seconds"] = time.time() - start
    print(f"[{name}] {result['tokens_per_s']:,.0f} tokens/s ({result['seconds']:.0f} s)", flush=True)
    return result


def sdpa_backends(shapes: list[tuple[int, int, int, int]], device: str) -> dict[str, dict[str, float]]:
    """Forward + backward ms of causal bf16 SDPA per kernel (flash, cuDNN, memory-efficient)."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results: dict[str, dict[str, float]] = {}
    for b, h, t, d in shapes:
        q, k, v = (torch.randn(b, h, t, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        row = {}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            def step(backend=backend, q=q, k=k, v=v, grad=grad):
                with sdpa_kernel([backend]):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(out, (q, k, v), grad)
            try:
                row[backend.name.lower()] = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
            except RuntimeError as e:
                row[backend.name.lower()] = float("nan")
                print(f"sdpa {backend.name} at {(b, h, t, d)}: {str(e).splitlines()[0]}")
        results[f"{b}x{h}x{t}x{d}"] = row
    return results


def output_gemm_widths(tokens: int, dim: int, widths: list[int], device: str) -> dict[int, float]:
    """ms of the output layer's three GEMMs (logits, input and weight gradients) per vocabulary width."""
    import triton.testing

    h = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    out = {}
    for v in widths:
        w = torch.randn(v, dim, device=device, dtype=torch.bfloat16)
        g = torch.randn(tokens, v, device=device, dtype=torch.bfloat16)
        out[v] = triton.testing.do_bench(lambda w=w, g=g: (h @ w.t(), g @ w, g.t() @ h), warmup=25, rep=100,
                                         return_mode="median")
    return out


def host_costs(device: str, calls: int = 2000, compile_backend: str = "inductor") -> dict[str, float]:
    """The host's microseconds per step of a launch-bound update, each timed until the calls return (the
    device's time not included): ``op``, an eager elementwise op on one element; ``linear_fwd_bwd``, forward
    and backward of a 16 x 16 ``nn.Linear`` (autograd's fixed cost on top of its 5 kernels);
    ``compiled_call``, a call of a compiled one-kernel function (guards and wrapper); on CUDA also
    ``launch_call``, the runtime's launch call itself (the profiler's mean), and ``graph_replay``, a replay
    of a CUDA graph of 100 such ops. They say whether a launch-bound step is slow for its launches or for
    its host."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.zeros(1, device=device)

    def per_call_us(fn, n: int) -> float:
        for _ in range(10):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        host = time.perf_counter() - start
        sync()
        return host / n * 1e6

    linear = torch.nn.Linear(16, 16, device=device)
    inputs = torch.randn(4, 16, device=device)

    def linear_fwd_bwd():
        linear.zero_grad(set_to_none=True)
        linear(inputs).sum().backward()

    compiled = torch.compile(lambda t: t * 2 + 1, backend=compile_backend)
    out = {"op": per_call_us(lambda: torch.add(x, 1, out=x), calls),
           "linear_fwd_bwd": per_call_us(linear_fwd_bwd, calls // 10),
           "compiled_call": per_call_us(lambda: compiled(x), calls)}
    if device == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(200):
                torch.add(x, 1, out=x)
            sync()
        launches = [e.cpu_time_total for e in prof.events() if e.name in KERNEL_LAUNCH_CALLS]
        out["launch_call"] = statistics.mean(launches) if launches else float("nan")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.add(x, 1, out=x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(100):
                torch.add(x, 1, out=x)
        out["graph_replay"] = per_call_us(graph.replay, calls // 10)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, required=True, help="append the JSON lines here")
    p.add_argument("--log-dir", type=Path, help="per-run logs and profiles (default: a temp dir)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="binarised LM data; made there (synthetic text, GPT-2-sized dictionary) if missing")
    p.add_argument("--only", nargs="+", help="run names to run (large_fast stock 1p3b_fast 1p3b_fp8 1p3b_fp8rw "
                                              "large_fast_cuda_graphs 1p3b_fast_cuda_graphs large_base; *_fp8: --fp8 "
                                              "tensorwise, *_fp8rw: rowwise)")
    p.add_argument("--micro", action=argparse.BooleanOptionalAction, default=True, help="host-cost, SDPA and GEMM-width runs")
    p.add_argument("--toy", action="store_true", help="tiny model on CPU, fp32 (checks the code path)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.toy
    device = "cuda" if cuda else "cpu"
    print(f"date: {now()} | commit {git_commit()} | {device_line(device)}", flush=True)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="ts_gpu_speed_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    vocab = 500 if args.toy else GPT2_VOCAB
    configs = {"toy": ("2 64 2 128", 2)} if args.toy else CONFIGS
    window, host_profile, profile = ((2, 3), 1, 5) if args.toy else (WINDOW, HOST_PROFILE, PROFILE)
    tokens_needed = max(c[1] for c in configs.values()) * (SEQ if not args.toy else 64) * (profile + 4)
    data = gpt2_sized_data(args.data.parent, tokens_needed, vocab) if not args.toy else \
        gpt2_sized_data(log_dir / "data", tokens_needed, vocab)
    vocab_padded = sum(1 for _ in (data / "dict.txt").open()) + 4
    peak_before = gemm_flops_per_s(8192, 8192, 8192, 20, device, "bf16") if cuda else float("nan")
    summary: dict = {"vocab": vocab_padded, "runs": {}}
    if cuda and args.micro:
        summary["host_us"] = host_costs(device)
        append_results(args.results, [(f"host_us_{k}", v, None) for k, v in summary["host_us"].items()], device,
                       "benchmarks/gpu_speed.py host_costs")
        summary["sdpa_ms"] = sdpa_backends([(8, 16, SEQ, 64), (4, 16, SEQ, 128)], device)
        summary["output_gemm_ms"] = output_gemm_widths(8 * SEQ, 1024, [vocab_padded, -(-vocab_padded // 128) * 128],
                                                       device)
        print(json.dumps({k: summary[k] for k in ("host_us", "sdpa_ms", "output_gemm_ms")}), flush=True)
    why_not = fused_master_step_unchecked(device)
    print(f"{FUSED_MASTER_STEP}: {'in the fast path' if why_not is None else f'not used ({why_not})'}", flush=True)
    plan = run_plan(configs, device, FAST + ([FUSED_MASTER_STEP] if why_not is None else []))
    for name, cname, flags, batch, metric_suffix in plan:
        if args.only and name not in args.only:
            continue
        tokens = batch * (SEQ if not args.toy else 64)
        result = run_profiled(name, train_args(data, flags, batch, args.toy), tokens, window, host_profile, profile,
                              log_dir, timeout=60 if args.toy else (150 if cname == "ts_lm_large" else 200))
        if result is not None:
            result["flops_per_token"] = flops_per_token(vocab_padded, SEQ if not args.toy else 64,
                                                        configs[cname][0])["total"]
            result["batch"] = batch
            summary["runs"][name] = result
            record(name, cname, metric_suffix, result, summary["runs"], peak_before, args.results, device)
            print_table({name: result})  # now, in case a time limit ends the call before the last run
    summary["gemm_peak"] = [peak_before, gemm_flops_per_s(8192, 8192, 8192, 20, device, "bf16") if cuda else None]
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    print("\nall runs:")
    print_table(summary["runs"])
    return 0


def fused_master_step_unchecked(device: str) -> str | None:
    """Why the fast path runs without ``--ts-fused-master-step``, or None: its kernel against torch's fused
    AdamW on the device (the GPU test ``MASTER_STEP_CHECK``) first, in a process of its own, so a kernel that
    fails costs that check and not the runs."""
    if device != "cuda":
        return "it runs on a CUDA device"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "gpu", MASTER_STEP_CHECK]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    except subprocess.TimeoutExpired:
        return "its GPU check ran past 240 s"
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        return f"its GPU check failed: {tail[0]}"
    return None


def run_plan(configs: dict, device: str, fast: list[str] = FAST) -> list[tuple[str, str, list[str], int, str | None]]:
    """(run name, config, fairseq-train flags, sequences per update, metric suffix or None; ``fast``: the fast
    path's flags), in the order a call cut by its time limit loses least: the fast path and stock, the fast path
    with CUDA graphs (the fastest so far: the MFU targets), FP8 tensorwise (``fp8_gain_1p3b``), then what the
    issue's target table does not name: the default path of ``ts_lm_large`` ("base") and FP8 rowwise."""
    order = {"fast": 0, "stock": 0, "graphs": 1, "fp8 tensorwise": 2, "base": 3, "fp8 rowwise": 4}
    plan = []
    for cname, (dims, batch) in configs.items():
        arch = ["--user-dir", str(USER_DIR), "--arch", "ts_lm_large", *decoder_dim_flags(dims), "--backbone", "magneto"]
        short = "large" if cname == "ts_lm_large" else cname
        plan.append(("fast", (f"{short}_fast", cname, arch + fast, batch, "")))
        if cname in ("ts_lm_large", "toy"):
            width = dims.split()[1]  # transformer_lm's input/output dims default to 512 whatever the width
            # the plugin's trainer: stock fairseq's --bf16 runs on TPUs only; model and loss are stock fairseq's
            stock = ["--user-dir", str(USER_DIR), "--arch", "transformer_lm", *decoder_dim_flags(dims),
                     "--decoder-input-dim", width, "--decoder-output-dim", width, "--optimizer", "adam"]
            plan.append(("stock", ("stock", cname, stock, batch, None)))
        if cname == "1p3b":
            why_not = fp8_unavailable(device)
            for name, recipe in FP8_RUNS.items():
                if why_not is None:
                    plan.append((f"fp8 {recipe}", (name, cname, arch + fast + ["--fp8", recipe], batch, None)))
                else:
                    print(f"not run: {name} ({why_not})", flush=True)
        if device == "cuda":
            plan.append(("graphs", (f"{short}_fast{GRAPHS}", cname, arch + fast + ["--ts-cuda-graphs"], batch, GRAPHS)))
        if cname != "1p3b":  # the 1.3B model's default path: measured twice on 2026-11-28
            plan.append(("base", (f"{short}_base", cname, arch + ["--optimizer", "adam"], batch, "_baseline")))
    return [run for _, run in sorted(plan, key=lambda kind_run: order[kind_run[0]])]  # stable: configs in order


def fp8_unavailable(device: str) -> str | None:
    """Why the FP8 runs cannot run here (the plugin's own refusal), or None."""
    from torchscale_fairseq.errors import TsConfigError
    from torchscale_fairseq.model_parallel.float8 import fp8_refusal, import_torchao_float8

    refusal = fp8_refusal(device, torch.cuda.get_device_capability() if device == "cuda" else None)
    if refusal:
        return refusal
    try:
        import_torchao_float8()
    except TsConfigError as e:
        return str(e)
    return None


def fastest_path(runs: dict, short: str) -> str | None:
    """The faster of the plugin's fast-path runs of a config measured so far (``{short}_fast``, with and
    without ``--ts-cuda-graphs``), by tokens/s; ``None`` before either ran."""
    names = [n for n in (f"{short}_fast", f"{short}_fast{GRAPHS}") if n in runs]
    return max(names, key=lambda n: runs[n]["tokens_per_s"], default=None)


def record(name: str, config: str, suffix: str | None, r: dict, runs: dict, peak: float, path: Path,
           device: str) -> None:
    """One run's metrics as JSON lines, as soon as it is measured: MFU under the run's suffix (the fast
    path's under the issue's names, ``*_cuda_graphs`` with graphs, ``*_baseline`` for the default path),
    tokens/s over stock once both ran, FP8 over bf16. The issue's own metric names hold *our fastest path*:
    where the run with graphs is the faster, its figures are appended again under them (the last line of a
    metric at a commit is the fastest path's; its command says which)."""
    short = "large" if config == "ts_lm_large" else config
    headline = suffix == GRAPHS and fastest_path(runs, short) == name  # graphs beat the fast path
    if suffix is not None:
        achieved = r["tokens_per_s"] * r["flops_per_token"]
        rows = []
        for metric_suffix in [suffix] + ([""] if headline else []):
            target = None if metric_suffix else TARGETS.get(f"mfu_datasheet_{config}")
            rows.append((f"mfu_datasheet_{config}{metric_suffix}", achieved / DATASHEET_BF16, target))
            if peak == peak:  # measured on a GPU
                rows.append((f"mfu_measured_{config}{metric_suffix}", achieved / peak, None))
        append_results(path, rows, device, r["command"])
        print("\n".join(f"RESULT {m} {v:.4f} (target {t})" for m, v, t in rows), flush=True)
    if config in ("ts_lm_large", "toy") and "stock" in runs:
        for run_suffix in ("", GRAPHS):
            fast_name = f"{short}_fast{run_suffix}"
            if name not in ("stock", fast_name) or fast_name not in runs:
                continue
            ratio = runs[fast_name]["tokens_per_s"] / runs["stock"]["tokens_per_s"]
            metrics = [f"tokens_per_s_vs_stock{run_suffix}"]
            metrics += ["tokens_per_s_vs_stock"] if run_suffix and fastest_path(runs, short) == fast_name else []
            append_results(path, [(m, ratio, TARGETS["tokens_per_s_vs_stock"]) for m in metrics], device,
                           runs[fast_name]["command"] + " vs " + runs["stock"]["command"])
            print("\n".join(f"RESULT {m} {ratio:.4f} (target {TARGETS['tokens_per_s_vs_stock']})" for m in metrics),
                  flush=True)
    bf16 = runs.get("1p3b_fast")
    for fp8_name, recipe in FP8_RUNS.items():
        if name in (fp8_name, "1p3b_fast") and bf16 is not None and fp8_name in runs:
            metric = "fp8_gain_1p3b" + ("" if recipe == "tensorwise" else f"_{recipe}")
            gain = runs[fp8_name]["tokens_per_s"] / bf16["tokens_per_s"]
            append_results(path, [(metric, gain, TARGETS["fp8_gain_1p3b"])], device,
                           runs[fp8_name]["command"] + " vs " + bf16["command"])
            print(f"RESULT {metric} {gain:.4f} (target {TARGETS['fp8_gain_1p3b']})", flush=True)


def print_table(runs: dict) -> None:
    """Where each run's profiled update spent its time (ms and share of the step), then the window's
    time per update beside the profiled update's device-busy and host times."""
    names = ("gemm", "attention", "norms_elementwise", "loss", "optimizer", "copies", "idle")
    print("\n| run | batch | tokens/s | step ms | " + " | ".join(names) + " | host syncs |")
    print("|---|---|---|---|" + "---|" * len(names) + "---|")
    for name, r in runs.items():
        prof = r.get("profile")
        if prof is None:
            print(f"| {name} | {r['batch']} | {r['tokens_per_s']:,.0f} | - |" + " - |" * len(names) + " - |")
            continue
        cells = " | ".join(f"{prof['rows_ms'][k]:.1f} ({100 * prof['rows_share'][k]:.0f}%)" for k in names)
        print(f"| {name} | {r['batch']} | {r['tokens_per_s']:,.0f} | {prof['step_ms']:.1f} | {cells} | "
              f"{prof['host_syncs']} |")
    ranges = ("forward", "backward", "clip-grads", "optimizer")
    print("\n| run | ms/update (window) | device busy | host in step | host between steps | "
          + " | ".join(f"host {k}" for k in ranges) + " |")
    print("|---|---|---|---|---|" + "---|" * len(ranges))
    for name, r in runs.items():
        prof = r.get("profile") or {}
        cells = [f"{prof[k]:.1f}" if k in prof else "-" for k in ("busy_ms", "host_ms")]
        cells += [f"{r['between_steps_ms']:.1f}"]
        cells += [f"{prof['host_ranges_ms'][k]:.1f}" if prof else "-" for k in ranges]
        print(f"| {name} | {r['ms_per_update']:.1f} | " + " | ".join(cells) + " |")
    print("\n| run | update interval median / max ms (update) | compilations | cudaMalloc / cudaFree / retries "
          "| window's peak allocated / reserved GB | gc ms (collections) | compile: functions eager, graph breaks |")
    print("|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        fallbacks = r.get("compile_fallbacks")
        broke = "-" if fallbacks is None else (
            f"{fallbacks['frames_run_eager']} eager, {fallbacks['graph_breaks']} breaks: "
            + ("; ".join(f"{n} x {reason[:80]}" for reason, n in fallbacks["reasons"].items()) or "none"))
        w = r.get("window_detail")
        if not w or not w["intervals_ms"]:
            print(f"| {name} | - | - | - | - | - | {broke} |")
            continue
        intervals = w["intervals_ms"]
        slowest = max(range(len(intervals)), key=intervals.__getitem__)
        a = w["allocator"]
        compiles = ", ".join(f"{k} {v:.0f}" for k, v in w["compilations"].items() if v) or "none"
        print(f"| {name} | {statistics.median(intervals):.1f} / {intervals[slowest]:.1f} ({r['window'][0] + slowest}) "
              f"| {compiles} | {a['num_device_alloc']:.0f} / {a['num_device_free']:.0f} / {a['num_alloc_retries']:.0f} "
              f"| {w['peak_allocated_gb']:.1f} / {w['peak_reserved_gb']:.1f} | {w['gc_ms']:.1f} ({w['gc_runs']}) "
              f"| {broke} |")
    for name, r in runs.items():
        host = r.get("host_profile")
        if host:
            print(f"\n{name}: host time per update under cProfile {host['ms_per_update']:.1f} ms; own time (ms, calls):")
            for f in host["top_tottime"][:10]:
                print(f"  {f['ms']:7.2f} {f['calls']:7.1f}  {f['function'][:150]}")


if __name__ == "__main__":
    sys.exit(main())
