"""``--amp`` on the CPU: the training step under ``torch.autocast("cpu", dtype=torch.bfloat16)``.

fairseq's ``--amp`` is ``torch.cuda.amp.autocast`` around the forward (``FairseqTask.train_step``)
plus a ``GradScaler``; on the CPU neither acts, so ``--amp`` trained in fp32 there and the model's
autocast paths ran only on a GPU. CPU autocast computes matrix products in bfloat16 (its type)
and keeps the parameters, gradients and optimizer in fp32; bfloat16's exponent range needs no
loss scaling (the GradScaler stays disabled without CUDA, at scale 1). Backward is not affected:
autograd replays the dtypes the forward chose.
"""

from __future__ import annotations

import torch


def cpu_autocast(amp: bool, device: torch.device) -> torch.autocast:
    """Autocast to bfloat16 when ``--amp`` trains on the CPU; a disabled context otherwise."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp and device.type == "cpu")
