"""Lower one AOT graph dumped on the CPU (TORCH_COMPILE_DEBUG=1: fx_graph_runnable.py) with inductor for a
*fake* CUDA sm_90 device on a CPU-only machine (CUDA queries patched, inputs FakeTensors on cuda, the RNG seed
prims replaced by constants), save every Triton kernel's source (IC='{"benchmark_kernel": true}' makes inductor
write its own estimate of each kernel's bytes, kernel_num_gb) and print them. Nothing is compiled or run.

    IC='{"benchmark_kernel": true}' python fake_sm90_traffic.py GRAPH_DIR OUT_DIR"""
import os, sys, types, json, math, re, importlib.util, traceback
graph_dir, out_dir = sys.argv[1], sys.argv[2]; sys.argv = sys.argv[:1]
os.makedirs(out_dir, exist_ok=True)
import torch
# ---- a fake H200 ----
class Props:
    name = "NVIDIA H200"; major = 9; minor = 0; multi_processor_count = 132; total_memory = 140 * 2**30
    regs_per_multiprocessor = 65536; max_threads_per_multi_processor = 2048; warp_size = 32
    max_threads_per_block = 1024; gcnArchName = ""; L2_cache_size = 60 * 2**20; shared_memory_per_block_optin = 232448
    shared_memory_per_multiprocessor = 233472; clock_rate = 1980000; uuid = "fake"; is_integrated = False
import torch.cuda
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_properties = lambda *a, **k: Props()
torch.cuda.get_device_name = lambda *a, **k: Props.name
torch.cuda.is_bf16_supported = lambda *a, **k: True
torch.cuda._lazy_init = lambda: None
torch.cuda.set_device = lambda *a, **k: None
import torch.cuda.random as _cr
torch.cuda._exchange_device = lambda i: 0
torch.cuda._maybe_exchange_device = lambda i: 0
for _m in (torch.cuda, _cr):
    _m.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)
    _m.set_rng_state = lambda *a, **k: None
import torch._C
import torch._subclasses.fake_tensor as _ft
_ft.init_gpu_context = lambda device: None
import torch.utils._triton as tu
tu.triton_hash_with_backend = lambda: "fake-sm90"
tu.has_triton = lambda: True
import torch._inductor.config as ic
ic.compile_threads = 1
for k, v in json.loads(os.environ.get("IC", "{}")).items():
    obj = ic
    for p in k.split(".")[:-1]: obj = getattr(obj, p)
    setattr(obj, k.split(".")[-1], v)
from torch._inductor.runtime.hints import DeviceProperties
_orig_create = DeviceProperties.create.__func__
def _create(cls, device):
    device = torch.device(device)
    if device.type == "cuda":
        return cls(type="cuda", index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536,
                   max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32)
    return _orig_create(cls, device)
DeviceProperties.create = classmethod(_create)
# ---- save each kernel's source (no compile) ----
from torch._inductor.async_compile import AsyncCompile
report = []
class Stub:
    def __init__(self, n): self.n = n
    def __getattr__(self, a): raise SystemExit(f"stub {self.n}.{a}")
def fake_triton(self, kernel_name, source_code, device_str="cuda"):
    with open(os.path.join(out_dir, kernel_name + ".py"), "w") as f: f.write(source_code)
    report.append(kernel_name)
    return Stub(kernel_name)
AsyncCompile.triton = fake_triton
AsyncCompile.wait = lambda self, scope: None
# ---- the graph ----
src = open(os.path.join(graph_dir, "fx_graph_runnable.py")).read()
src = src.replace("os.environ['TORCH_COMPILE_DEBUG'] = '1'", "")
src = src.replace("device(type='cpu')", "device(type='cuda', index=0)")
src = re.sub(r"torch\.ops\.prims\.inductor_lookup_seed\.default\((\w+), (\d+)\)", r"torch.ops.aten.select.int(\1, 0, \2)", src)
src = re.sub(r"torch\.ops\.prims\.inductor_seeds\.default\((\d+), device\(type='cuda', index=0\)\)",
             r"torch.ops.aten.full.default([\1], 7, dtype=torch.int64, device=device(type='cuda', index=0), pin_memory=False)", src)
src = src.split("\nmod = Repro()")[0] + "\nmod = Repro()\n"
mod = types.ModuleType("repro"); mod.math_ceil = math.ceil; mod.math_floor = math.floor
exec(compile(src, "repro", "exec"), mod.__dict__)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.experimental.proxy_tensor import make_fx
from torch._inductor.compile_fx import compile_fx_inner
from torch._guards import tracing, TracingContext
fm = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
class Reader:
    def __init__(self): self.args = []
    def storage(self, *a, **k): return None
    def tensor(self, storage, shape, stride=None, storage_offset=None, dtype=None, requires_grad=None, is_leaf=None, **k):
        with fm:
            t = torch.empty(shape, dtype=dtype, device="cuda") if stride is None else torch.empty_strided(shape, stride, dtype=dtype, device="cuda")
        self.args.append(t); return t
    def symint(self, v):
        self.args.append(v); return v
r = Reader()
mod.load_args(r)
dynamic = "tracing_mode='symbolic'" in open(os.path.join(graph_dir, "fx_graph_runnable.py")).read()
try:
    if dynamic:
        from torch._dynamo.utils import detect_fake_mode
        gm = make_fx(mod.mod, tracing_mode="symbolic")(*r.args)
        fake = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        fm2 = detect_fake_mode(fake)
        with fm2, tracing(TracingContext(fm2)):
            compile_fx_inner(gm, fake)
    else:
      with fm, tracing(TracingContext(fm)):
        gm = make_fx(mod.mod, tracing_mode="real")(*r.args)
        compile_fx_inner(gm, r.args)
except BaseException as e:
    print("ended:", type(e).__name__, str(e)[:400]); traceback.print_exc()
total = 0.0
for name in report:
    text = open(os.path.join(out_dir, name + ".py")).read()
    gb = float(re.search(r"'kernel_num_gb': ([0-9.e-]+)", text).group(1))
    total += gb
    print(f"{name} {gb:.6f} GB")
print(f"{len(report)} kernels, {total:.6f} GB at the traced shapes")
