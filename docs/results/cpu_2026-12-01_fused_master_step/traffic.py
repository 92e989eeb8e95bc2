"""Bytes per parameter element that one ``--bf16 --optimizer ts_adamw`` update's optimizer part moves (after the
backward: ``zero_grad`` of the next update, the gradient norm, the pending multiply, the step), counted from the
aten ops it dispatches, for ``ts_lm_large``'s layer (2 layers, width 256, on the CPU: bytes per element do not
depend on the size; tensors under 64 elements, the step counts and scalars, are left out):

- ``before``: the wrapper as it was before b2e524b (every master gradient zeroed in ``zero_grad``, the multiply a
  pass of its own);
- ``wrapper``: the wrapper now (``--ts-fused-master-step`` off);
- ``fused``: the flag on: the torch ops left (the norm of the bf16 gradients, the table's copy), plus the kernel,
  whose loads and stores are read from its code (``master_adamw_kernel.py``: 2 + 12 bytes read, 12 + 2 written).

Each op's reads are its tensor arguments and its writes the arguments its schema marks written plus its outputs;
an op that only overwrites (``zero_``, ``fill_``, ``copy_``'s destination) reads nothing there.

    python traffic.py DATA_BIN
"""

import collections
import sys

import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.optim import FP16Optimizer
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.cli_utils import USER_DIR
from tests.workers.dist_harness import sample_of
from torchscale_fairseq.integration.trainer import TsTrainer
from torchscale_fairseq.optim.adamw import TorchAdamW

OVERWRITE_ONLY = {"zero_", "fill_", "_foreach_zero_", "copy_", "_foreach_copy_"}
KERNEL_BYTES = 2 + 12 + 12 + 2


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value] if value.numel() >= 64 else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Traffic(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.read, self.written, self.ops = collections.Counter(), collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if func.is_view:  # a view moves no data
            return out
        values = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
        for arg, value in zip(func._schema.arguments, values):
            written = arg.alias_info is not None and arg.alias_info.is_write
            if name.startswith("_fused_adam") and arg.name == "grads":  # written back only with a grad_scale
                written = kwargs.get("grad_scale") is not None
            if written:
                self.written[name] += _bytes(_tensors(value))
            if not (written and name in OVERWRITE_ONLY):
                self.read[name] += _bytes(_tensors(value))
        if not any(a.alias_info is not None for a in func._schema.arguments):
            self.written[name] += _bytes(_tensors(out))  # a new tensor (an in-place op returns its argument)
        return out


def trainer(data: str, *flags: str) -> TsTrainer:
    argv = [data, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_large", "--cpu", "--bf16",
            "--backbone", "magneto", "--decoder-layers", "2", "--decoder-embed-dim", "256",
            "--decoder-ffn-embed-dim", "1024", "--decoder-attention-heads", "4", "--tokens-per-sample", "16",
            "--optimizer", "ts_adamw", "--lr", "1e-3", "--max-tokens", "4096", *flags]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    return TsTrainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))


def measure(data: str, mode: str) -> tuple[float, float, dict]:
    t = trainer(data, *(["--ts-fused-master-step"] if mode == "fused" else []))
    t.train_step([sample_of(torch.randint(4, 30, (4, 17), generator=torch.Generator().manual_seed(0)))])
    opt = t.optimizer
    numel = sum(p.numel() for p in opt.fp16_params)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g).bfloat16() for p in opt.fp16_params]
    with Traffic() as traffic:
        (FP16Optimizer.zero_grad if mode == "before" else type(opt).zero_grad)(opt)
        for p, grad in zip(opt.fp16_params, grads):
            p.grad = grad
        opt._needs_sync = True
        opt.multiply_grads(1 / 2048)
        opt.clip_grad_norm(0.0)
        opt.step()
    read, written = sum(traffic.read.values()) / numel, sum(traffic.written.values()) / numel
    ops = {name: round((traffic.read[name] + traffic.written[name]) / numel, 2) for name in traffic.read | traffic.written}
    if mode == "fused":
        read, written = read + 14, written + 14
        ops["Triton kernel (from its code)"] = KERNEL_BYTES
    return read, written, ops


def main() -> None:
    data = sys.argv[1]
    print("| path | bytes read per element | bytes written | total | by op (read + written) |")
    print("|---|---|---|---|---|")
    for mode in ("before", "wrapper", "fused"):
        if mode == "before":
            scale = TorchAdamW.supports_step_with_scale
            TorchAdamW.supports_step_with_scale = property(lambda self: False)
        read, written, ops = measure(data, mode)
        if mode == "before":
            TorchAdamW.supports_step_with_scale = scale
        shown = ", ".join(f"{k} {v:g}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if v >= 0.01)
        print(f"| {mode} | {read:.2f} | {written:.2f} | {read + written:.2f} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
