"""fairseq's ``--fp16`` / ``--bf16`` wrapper (``FP16Optimizer``) with its fp32 master copied to and
from the 16-bit parameters by one multi-tensor copy each way, and its per-parameter masters' gradients
zeroed by one multi-tensor fill.

fairseq copies every parameter's gradient into its fp32 master, and every master back into its
parameter, one ``copy_`` per parameter: two launches and their Python per parameter and update,
host time during which the device waits when the step is bound by its host (the issue-43 profile
in ``benchmarks/RESULTS.md``). Here each direction is one ``torch._foreach_copy_``: over the
per-parameter masters (``--bf16``, which fairseq never flattens, and ``--fp16-no-flatten-grads``),
or over the flat master's per-parameter views (``--fp16``; ``split`` by the parameters' sizes, in
fairseq's order). The same values, bit for bit; per-parameter masters take fairseq's path when a
parameter or its master has no gradient (the first update, an expert no token reached). fairseq's
``zero_grad`` zeroes per-parameter masters' gradients one ``zero_`` each, at the start of every update
(a launch per parameter); here one ``torch._foreach_zero_``.
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
            return
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
        """fairseq's ``_FP16OptimizerMixin.zero_grad``, the per-parameter masters' gradients zeroed by one
        multi-tensor fill."""
        if self.has_flat_params:
            super().zero_grad()
            return
        for p in self.fp16_params:
            p.grad = None
        grads = [p32.grad for p32 in self.fp32_params if p32.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        self._needs_sync = False
        if self.scaler is not None:
            self._multiply_factor = 1.0 / float(self.scaler.loss_scale)
