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
"""

from __future__ import annotations

from collections import defaultdict

import torch
from fairseq.optim import FP16Optimizer


class ForeachFP16Optimizer(FP16Optimizer):
    """:class:`fairseq.optim.FP16Optimizer` with multi-tensor copies of the flat master (module docstring)."""

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
