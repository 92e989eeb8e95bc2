"""fairseq's ``--fp16`` / ``--bf16`` wrapper (``FP16Optimizer``) with its fp32 master copied to and
from the 16-bit parameters by one multi-tensor copy each way, and its masters' gradients zeroed only
where that copy does not overwrite them.

fairseq copies every parameter's gradient into its fp32 master, and every master back into its
parameter, one ``copy_`` per parameter: two launches and their Python per parameter and update,
host time during which the device waits when the step is bound by its host (the issue-43 profile
in ``benchmarks/RESULTS.md``). Here each direction is one ``torch._foreach_copy_``: over the
per-parameter masters (``--bf16``, which fairseq never flattens, and ``--fp16-no-flatten-grads``),
or over the flat master's per-parameter views (``--fp16``; ``split`` by the parameters' sizes, in
fairseq's order). The same values, bit for bit; per-parameter masters take fairseq's path when a
parameter or its master has no gradient (the first update, an expert no token reached).

fairseq's ``zero_grad`` zeroes the masters' gradients at the start of every update (per-parameter
masters one ``zero_`` each), and the copy above then overwrites every one of them (a parameter
without a gradient copies zeros). Here ``zero_grad`` leaves them, and they are zeroed (one
``torch._foreach_zero_``) only where the copy does not come: an update that reads them with no
backward since ``zero_grad``. That saves a write of every fp32 gradient per update.

fairseq resets the pending gradient multiply (``_multiply_factor``) in ``zero_grad`` only with fp16's
loss scaler; where the fp32 optimizer takes it as ``step(scale=...)`` (``supports_step_with_scale``)
nothing resets it under ``--bf16``, and each update's factor would multiply into the next one's
(fairseq 0.12.3, ``_FP16OptimizerMixin.zero_grad``). Here it restarts at 1 without a scaler, as
fairseq's memory-efficient wrapper does.

``--ts-fused-master-step`` (:meth:`ForeachFP16Optimizer.use_master_adamw`, per-parameter masters) replaces the
copy in, the fused AdamW step and the copy back by one kernel
(:class:`~torchscale_fairseq.optim.master_adamw.MasterAdamW`) once torch's AdamW has made its state (its
first step runs the path above); the gradient norm is then taken over the 16-bit gradients, of which the
fp32 ones would be exact copies, and the masters keep no gradients.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Callable

import torch
from fairseq.optim import FP16Optimizer

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.optim.grad_norm import norm_and_clip_
from torchscale_fairseq.optim.master_adamw import FLAG, MasterAdamW

logger = logging.getLogger(__name__)


class ForeachFP16Optimizer(FP16Optimizer):
    """:class:`fairseq.optim.FP16Optimizer` with multi-tensor copies of the flat master (module docstring)."""

    master_adamw: MasterAdamW | None = None
    _norm_parallel: ParallelContext | None = None

    def use_master_adamw(self, parallel: ParallelContext | None) -> None:
        """``--ts-fused-master-step``: update the per-parameter masters by one kernel; the gradient norm over
        ``parallel``'s groups (``None``: one process)."""
        if self.has_flat_params:
            raise TsConfigError(f"{FLAG} steps per-parameter masters (--bf16), and this run's master is flat: drop it")
        self.master_adamw, self._norm_parallel = MasterAdamW(self.fp32_optimizer.optimizer), parallel

    def _fused_update(self) -> bool:
        return self.master_adamw is not None and self.master_adamw.ready(self.fp32_params)

    def clip_grad_norm(self, max_norm: float, aggregate_norm_fn: Callable | None = None) -> torch.Tensor:
        """fairseq's (its branch without a loss scaler), the norm of the 16-bit gradients where one kernel
        makes the update."""
        if not self._fused_update() or self.scaler is not None:
            return super().clip_grad_norm(max_norm, aggregate_norm_fn)
        with_grad = [p for p in self.fp16_params if p.grad is not None]
        norm = (norm_and_clip_(with_grad, 0.0, self._norm_parallel, 1.0, aggregate_norm_fn)[1] if with_grad
                else torch.zeros((), device=self.fp16_params[0].device))
        grad_norm = self._multiply_factor * norm
        if torch.is_tensor(self._multiply_factor):
            self._multiply_factor = self._multiply_factor.to(grad_norm.device)
        if max_norm > 0.0:
            self._multiply_factor *= (max_norm / (grad_norm + 1e-6)).clamp_(max=1)
        return grad_norm

    def step(self, closure: Callable | None = None, groups: Any = None) -> None:
        """fairseq's, or one kernel (``--ts-fused-master-step``, once torch's AdamW has its state). A kernel that
        fails to build on its first launch is logged once and the path above runs from then on."""
        if not self._fused_update() or closure is not None or groups is not None:
            return super().step(closure, groups)
        try:
            self.master_adamw.step(self.fp16_params, self.fp32_params, 1.0 / self._multiply_factor)
        except Exception as error:  # a kernel that did not build: the reference path runs
            if self.master_adamw.launched:
                raise
            logger.warning(f"{FLAG}: the Triton kernel did not build ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else ''}); fairseq's copies and torch's fused "
                           "AdamW update the masters instead")
            self.master_adamw = None
            return super().step(closure, groups)
        for p32 in self.fp32_params:  # the kernel forms no fp32 gradients: free what the first update made
            p32.grad = None
        self._multiply_factor, self._needs_sync = 1.0, False

    def _params_by_device(self) -> dict:
        """The 16-bit parameters of each master, in the master's order (fairseq's grouping)."""
        by_device = defaultdict(list)
        for p in self.fp16_params:
            by_device[p.device.index].append(p)
        return {device: by_device[device] for device in self.fp32_params}

    def _pairs(self) -> list:
        """(16-bit parameter, its fp32 master) of the per-parameter masters, as fairseq pairs them."""
        return [(p, p32) for p, p32 in zip(self.fp16_params, self.fp32_params) if p.requires_grad]

    def _sync_fp16_grads_to_fp32(self) -> None:
        if not self._needs_sync:
            if getattr(self, "_stale_master_grads", False):  # no backward since zero_grad: fairseq's zeros
                self._zero_master_grads()
            return
        self._stale_master_grads = False  # the copy overwrites every master gradient
        if self.has_flat_params:
            for device, params in self._params_by_device().items():
                grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                torch._foreach_copy_(list(self.fp32_params[device].grad.split([g.numel() for g in grads])), grads)
        else:
            pairs = self._pairs()
            if any(p.grad is None or p32.grad is None for p, p32 in pairs):
                return super()._sync_fp16_grads_to_fp32()
            torch._foreach_copy_([p32.grad for _, p32 in pairs], [p.grad for p, _ in pairs])
        self._needs_sync = False

    def _sync_fp32_params_to_fp16(self) -> None:
        if self.has_flat_params:
            for device, params in self._params_by_device().items():
                targets = [p.data.view(-1) for p in params]
                torch._foreach_copy_(targets, list(self.fp32_params[device].data.split([t.numel() for t in targets])))
        else:
            pairs = self._pairs()
            torch._foreach_copy_([p.data for p, _ in pairs], [p32.data for _, p32 in pairs])

    def zero_grad(self) -> None:
        """fairseq's ``_FP16OptimizerMixin.zero_grad`` with the masters' gradients zeroed only if read before the
        next copy (module docstring), and the pending multiply restarted at 1 without a loss scaler."""
        for p in self.fp16_params:
            p.grad = None
        self._needs_sync = False
        self._stale_master_grads = True
        self._multiply_factor = 1.0 / float(self.scaler.loss_scale) if self.scaler is not None else 1.0

    def _zero_master_grads(self) -> None:
        if self.has_flat_params:
            for master in self.fp32_params.values():
                master.grad.zero_()
        else:
            grads = [p32.grad for p32 in self.fp32_params if p32.grad is not None]
            if grads:
                torch._foreach_zero_(grads)
        self._stale_master_grads = False
