"""Lower one AOT graph dumped on the CPU (``TORCH_COMPILE_DEBUG=1``: its ``fx_graph_runnable.py``) with
inductor for a stand-in CUDA sm_90 device on a machine without a GPU, save each Triton kernel's source and
print inductor's own estimate of the bytes each moves (``kernel_num_gb``, written with ``benchmark_kernel``),
then the compiled graph's ``call``: its Triton launches and its other ops (GEMMs, ``extern_kernels``, and the
PyTorch ops inductor falls back to, each one or more CUDA kernels); its wrapper code is saved as ``wrapper.py``.
The inductor options the graph was compiled with (``combo_kernels`` among them) come with the dump.
Nothing is compiled for or run on a device: the CUDA queries inductor makes are answered with an H200's
properties, the inputs are fake tensors on ``cuda``, and the RNG seed prims of dropout become constants.

    python fake_sm90_traffic.py GRAPH_DIR OUT_DIR

``COMBO_KERNELS=1`` / ``0``: lower with inductor's ``combo_kernels`` on / off, whatever the dump says.
``SKIP_VIEW_SCATTER=1``: skip inductor's ``canonicalize_view_scatter_ops`` pass, which fails on the MoE layer's
backward graph under these fake tensors ("can not broadcast torch.Size([1024]) to torch.Size([1024])"); it only
changes how a ``select_scatter`` is written in place.
"""

from __future__ import annotations

import math
import os
import re
import sys
import types
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.utils._triton as torch_triton
from torch._guards import TracingContext, tracing
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.runtime.hints import DeviceProperties
from torch._subclasses import fake_tensor
from torch.fx.experimental.proxy_tensor import make_fx


class H200:
    name, major, minor, multi_processor_count, total_memory = "NVIDIA H200", 9, 0, 132, 140 * 2**30
    regs_per_multiprocessor, max_threads_per_multi_processor, warp_size = 65536, 2048, 32
    max_threads_per_block, gcnArchName, L2_cache_size, uuid, is_integrated = 1024, "", 60 * 2**20, "fake", False
    shared_memory_per_block_optin, shared_memory_per_multiprocessor, clock_rate = 232448, 233472, 1980000


def stand_in_device() -> None:
    """Answer inductor's CUDA queries as an H200 would; no driver is touched."""
    for name, value in dict(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
                            get_device_capability=lambda *a, **k: (9, 0), get_device_properties=lambda *a, **k: H200(),
                            get_device_name=lambda *a, **k: H200.name, is_bf16_supported=lambda *a, **k: True,
                            _lazy_init=lambda: None, set_device=lambda *a, **k: None, _exchange_device=lambda i: 0,
                            _maybe_exchange_device=lambda i: 0).items():
        setattr(torch.cuda, name, value)
    for module in (torch.cuda, torch.cuda.random):
        module.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)
        module.set_rng_state = lambda *a, **k: None
    fake_tensor.init_gpu_context = lambda device: None
    torch_triton.triton_hash_with_backend = lambda: "stand-in-sm90"
    torch_triton.has_triton = lambda: True
    inductor_config.compile_threads = 1
    inductor_config.benchmark_kernel = True  # writes kernel_num_gb into each kernel's metadata
    original = DeviceProperties.create.__func__

    def create(cls, device):
        if torch.device(device).type == "cuda":
            return cls(type="cuda", index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536,
                       max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32)
        return original(cls, device)

    DeviceProperties.create = classmethod(create)


def main(graph_dir: Path, out_dir: Path) -> None:
    stand_in_device()
    if os.environ.get("SKIP_VIEW_SCATTER") == "1":
        import torch._inductor.fx_passes.reinplace as reinplace

        reinplace.canonicalize_view_scatter_ops = lambda graph: None
    out_dir.mkdir(parents=True, exist_ok=True)
    kernels: list[str] = []

    def save_kernel(self, kernel_name, source_code, device_str="cuda"):
        (out_dir / f"{kernel_name}.py").write_text(source_code)
        kernels.append(kernel_name)

    AsyncCompile.triton = save_kernel
    AsyncCompile.wait = lambda self, scope: None
    src = (graph_dir / "fx_graph_runnable.py").read_text()
    dynamic = "tracing_mode='symbolic'" in src
    src = src.replace("os.environ['TORCH_COMPILE_DEBUG'] = '1'", "")
    src = src.replace("device(type='cpu')", "device(type='cuda', index=0)")
    src = re.sub(r"torch\.ops\.prims\.inductor_lookup_seed\.default\((\w+), (\d+)\)",
                 r"torch.ops.aten.select.int(\1, 0, \2)", src)
    src = re.sub(r"torch\.ops\.prims\.inductor_seeds\.default\((\d+), device\(type='cuda', index=0\)\)",
                 r"torch.ops.aten.full.default([\1], 7, dtype=torch.int64, device=device(type='cuda', index=0), "
                 r"pin_memory=False)", src)
    src = src.split("\nmod = Repro()")[0] + "\nmod = Repro()\n"
    repro = types.ModuleType("repro")
    repro.math_ceil, repro.math_floor = math.ceil, math.floor
    exec(compile(src, "repro", "exec"), repro.__dict__)  # the graph's module and its inputs' shapes
    if "COMBO_KERNELS" in os.environ:  # lower with combo kernels on (1) or off (0), whatever the dump says
        inductor_config.combo_kernels = os.environ["COMBO_KERNELS"] == "1"
    mode = fake_tensor.FakeTensorMode(shape_env=torch.fx.experimental.symbolic_shapes.ShapeEnv())
    inputs: list = []

    class Reader:
        def storage(self, *args, **kwargs):
            return None

        def tensor(self, storage, shape, stride=None, dtype=None, **kwargs):
            with mode:
                t = torch.empty_strided(shape, stride or torch._prims_common.make_contiguous_strides_for(shape),
                                        dtype=dtype, device="cuda")
            inputs.append(t)
            return t

        def symint(self, value):
            inputs.append(value)
            return value

    repro.load_args(Reader())
    if dynamic:
        gm = make_fx(repro.mod, tracing_mode="symbolic")(*inputs)
        fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        graph_mode = torch._dynamo.utils.detect_fake_mode(fakes)
        with graph_mode, tracing(TracingContext(graph_mode)):
            compiled = compile_fx_inner(gm, fakes)
    else:
        with mode, tracing(TracingContext(mode)):
            compiled = compile_fx_inner(make_fx(repro.mod, tracing_mode="real")(*inputs), inputs)
    total, unpriced = 0.0, 0
    for name in kernels:
        found = re.search(r"'kernel_num_gb': ([0-9.e-]+)", (out_dir / f"{name}.py").read_text())
        if found is None:  # a combo kernel (combo_kernels=True) carries no byte estimate
            unpriced += 1
            print(f"{name} (combo kernel: no estimate)")
            continue
        total += float(found.group(1))
        print(f"{name} {float(found.group(1)):.6f} GB")
    print(f"{len(kernels)} kernels, {total:.6f} GB at the traced shapes"
          + (f" ({unpriced} combo kernels not counted)" if unpriced else ""))
    (out_dir / "wrapper.py").write_text(compiled.source_code)
    body = compiled.source_code.split("    def call(self, args):")[1].split("\ndef ")[0]
    lines = [line.strip() for line in body.splitlines() if not line.strip().startswith(("#", "assert_"))]
    others = [re.sub(r"\(.*", "", line.split("= ")[-1]) for line in lines
              if re.search(r"extern_kernels\.|aten\.|torch\.ops\.", line)]
    print(f"call(): {sum('.run(' in line for line in lines)} Triton launches, {len(others)} other ops: {', '.join(others)}")


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/fake_sm90_inductor_cache")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
