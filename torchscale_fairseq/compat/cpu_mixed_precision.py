"""``--fp16``'s flat fp32 master on the CPU (fairseq 0.12.2 and fairseq-fixed 0.12.3.1).

The flat fp32 master of ``FP16Optimizer`` (``--fp16`` without ``--fp16-no-flatten-grads``)
is keyed by ``torch.cuda.current_device()``, which fails without CUDA. For CPU parameters
:func:`flat_master_on_cpu` builds the same single flat copy keyed by their device index
(``None``), the key the rest of ``FP16Optimizer`` looks up (``p.device.index``). (``--bf16``
never flattens: fairseq turns flattening off for it; its ``--tpu`` is cleared in
``integration/bf16_device.py``.)
"""

from __future__ import annotations

from typing import Sequence

import torch
from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin


def flat_master_on_cpu(params: Sequence[torch.Tensor]) -> dict[None, torch.nn.Parameter] | None:
    """fairseq's flat fp32 master of ``params`` (their values, one flat vector, a gradient
    buffer of the same size) when they live on the CPU; ``None`` otherwise."""
    if not params or params[0].device.type != "cpu":
        return None
    master = torch.nn.Parameter(torch.cat([p.data.reshape(-1).float() for p in params]))
    master.grad = master.data.new(master.numel())
    return {None: master}


_STOCK_BUILD_FP32_PARAMS = _FP16OptimizerMixin.build_fp32_params.__func__


@classmethod
def build_fp32_params(cls, args, params, flatten=True):
    """fairseq's ``build_fp32_params``, with the flat master of CPU parameters built on the CPU."""
    return (flatten and flat_master_on_cpu(params)) or _STOCK_BUILD_FP32_PARAMS(cls, args, params, flatten)


def patch_cpu_mixed_precision() -> None:
    _FP16OptimizerMixin.build_fp32_params = build_fp32_params
