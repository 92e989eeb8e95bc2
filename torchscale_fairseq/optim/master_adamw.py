"""``--ts-fused-master-step``: the whole update of ``--bf16``'s fp32 masters under ``--optimizer
ts_adamw`` as one Triton kernel over every parameter.

Per element, with the 16-bit gradient ``g16`` (0 where the parameter has none), fairseq's pending
gradient multiply as a divisor ``s`` (``1 / _multiply_factor``: ``1 / tokens``, clipping), the fp32
master ``p``, torch's AdamW state of that master (moments ``m``, ``v``; step ``t``, from 1) and the
16-bit parameter ``p16``:

    g   = float(g16) / s
    p  <- p - lr * weight_decay * p
    m  <- beta1 * m + (1 - beta1) * g
    v  <- beta2 * v + (1 - beta2) * g^2
    p  <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    p16 <- bfloat16(p)

That is torch's fused AdamW (``grad_scale``, ``found_inf``: nothing written where it is 1, the step
counts kept) on the fp32 gradient fairseq's wrapper copies from ``g16``, then the copy back. Here
``g16`` is read once and the masters' gradients are never formed: per element the kernel reads 2 +
12 bytes and writes 12 + 2, where the wrapper's copy (6), fused step (32, with its write-back of
``g / s``) and copy back (6) move 44; and no fp32 gradients are kept (4 bytes per parameter).

One launch covers every parameter: a table of each parameter's addresses, made per update (the
16-bit gradients are new tensors each update) and copied to the device from pinned memory without
a host sync; each program updates ``BLOCK`` elements of one parameter. The reference is the
wrapper's own path (:class:`~torchscale_fairseq.optim.flat_master.ForeachFP16Optimizer` without the
flag), which the tests compare it with; on the CPU the kernel runs in Triton's interpreter.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

from torchscale_fairseq.errors import TsConfigError

logger = logging.getLogger(__name__)

BLOCK = 4096  # elements per program
FLAG = "--ts-fused-master-step"


def check_fused_master_step(cfg: Any, cuda: bool) -> None:
    """The flag's one-line refusals before anything is built (``cuda``: the run is on a CUDA device)."""
    common, optimizer = cfg.common, cfg.optimizer
    impl = getattr(optimizer, "adamw_impl", None)
    clashes = [
        (not cuda and os.environ.get("TRITON_INTERPRET") != "1",
         "runs a Triton kernel on a CUDA device (on the CPU only in Triton's interpreter, TRITON_INTERPRET=1): drop it"),
        (not common.bf16 or common.fp16 or common.amp, "steps --bf16's fp32 masters: add --bf16 or drop it"),
        (getattr(common, "memory_efficient_bf16", False), "steps fp32 masters, which --memory-efficient-bf16 has not: "
                                                          "use --bf16 or drop it"),
        (optimizer._name != "ts_adamw", f"is AdamW's update: use --optimizer ts_adamw (not {optimizer._name}) or drop it"),
        (impl is not None and str(impl) != "fused", f"replaces ts_adamw's fused kernel: drop --adamw-impl {impl} or it"),
        (cfg.distributed_training.zero_sharding != "none",
         f"with --zero-sharding {cfg.distributed_training.zero_sharding} is not supported yet: drop one of them"),
    ]
    why = next((why for clash, why in clashes if clash), None)
    if why is not None:
        raise TsConfigError(f"{FLAG} {why}")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise TsConfigError(f"{FLAG} needs Triton (pip install triton; CUDA builds of torch bring it): install it or "
                            "drop the flag") from None


class MasterAdamW:
    """The kernel's launches for the masters of ``optimizer`` (torch's AdamW: one parameter group,
    decoupled weight decay, no AMSGrad, not maximising); the AdamW state stays torch's, so checkpoints
    and the reference path read the same tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not (isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults.get("fused")):
            raise TsConfigError(f"{FLAG} replaces torch's fused AdamW, and this run steps {type(optimizer).__name__} "
                                f"({'fused' if optimizer.defaults.get('fused') else 'not fused'}): use --optimizer "
                                "ts_adamw on parameters its fused kernel takes, or drop the flag")
        if len(optimizer.param_groups) != 1:
            raise TsConfigError(f"{FLAG} steps one parameter group, and this optimizer has "
                                f"{len(optimizer.param_groups)}: drop the flag")
        (group,) = optimizer.param_groups
        if group["amsgrad"] or group["maximize"]:
            raise TsConfigError(f"{FLAG} is AdamW's update, without amsgrad or maximize: drop the flag")
        self.optimizer = optimizer
        self._chunks: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None
        self._constants: dict[tuple, torch.Tensor] = {}
        self.launched = False  # a first launch that fails (a kernel that did not build) is the caller's to handle

    def ready(self, masters: list[torch.Tensor]) -> bool:
        """Every master has its AdamW state (torch's first step makes it)."""
        state = self.optimizer.state
        return all("exp_avg" in state.get(p, ()) for p in masters)

    def _chunk_tables(self, numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each program's parameter and first element (made once per set of parameter sizes)."""
        if self._chunks is None or self._chunks[0] != numels:
            param = torch.cat([torch.full((math.ceil(n / BLOCK),), i, dtype=torch.int32) for i, n in enumerate(numels)])
            start = torch.cat([torch.arange(0, n, BLOCK, dtype=torch.int64) for n in numels])
            self._chunks = (numels, param.to(device), start.to(device))
        return self._chunks[1], self._chunks[2]

    def _constant(self, key: tuple, values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if key not in self._constants:
            self._constants[key] = torch.tensor(values, dtype=dtype, device=device)
        return self._constants[key]

    @torch.no_grad()
    def step(self, params16: list[torch.Tensor], masters: list[torch.Tensor], scale: float | torch.Tensor) -> None:
        """One update of ``masters`` from the gradients of ``params16`` (the same order), written back to
        ``params16``; ``scale``: the divisor of every gradient (module docstring). The step counts advance
        after the launch (by 0 where ``found_inf`` is 1), so a kernel that fails to build changes nothing."""
        from torchscale_fairseq.optim.master_adamw_kernel import KERNELS

        state, group = self.optimizer.state, self.optimizer.param_groups[0]
        device = masters[0].device
        rows, steps, grads = [], [], []
        for p16, p in zip(params16, masters):
            s, g = state[p], p16.grad
            if g is not None:
                grads.append(g.contiguous())  # held until the launch: the table has its address
            rows.append((p.numel(), p16.data_ptr(), 0 if g is None else grads[-1].data_ptr(), p.data_ptr(),
                         s["exp_avg"].data_ptr(), s["exp_avg_sq"].data_ptr(), s["step"].data_ptr()))
            steps.append(s["step"])
        cuda = device.type == "cuda"
        aligned = all(row[0] % 16 == 0 and all(a % 16 == 0 for a in row[1:6]) for row in rows)
        table = torch.tensor(rows, dtype=torch.int64, pin_memory=cuda).to(device, non_blocking=True)
        chunk_param, chunk_start = self._chunk_tables(tuple(r[0] for r in rows), device)
        scale = (scale.detach().to(device=device, dtype=torch.float32).reshape(1) if torch.is_tensor(scale)
                 else torch.full((1,), float(scale), dtype=torch.float32, device=device))
        found_inf = getattr(self.optimizer, "found_inf", None)
        skip = (found_inf.to(device=device, dtype=torch.float32).reshape(1) if found_inf is not None
                else self._constant(("no skip",), [0.0], torch.float32, device))
        beta1, beta2 = group["betas"]
        log_betas = self._constant(("log betas", beta1, beta2), [math.log(beta1), math.log(beta2)], torch.float64, device)
        KERNELS["cuda" if cuda else "cpu"][(chunk_param.numel(),)](
            table, chunk_param, chunk_start, scale, skip, log_betas, float(group["lr"]), beta1, beta2,
            group["eps"], group["weight_decay"], BLOCK=BLOCK, ALIGNED=aligned, **({"num_warps": 8} if cuda else {}))
        self.launched = True
        if found_inf is None:
            torch._foreach_add_(steps, 1)
        else:
            torch._foreach_add_(steps, [1 - skip.reshape(())] * len(steps))
