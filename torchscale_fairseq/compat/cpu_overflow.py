"""fairseq's gradient-overflow handler crashes without CUDA.

``Trainer.train_step`` catches ``OverflowError`` (fp16 loss-scale overflow, or a
non-finite SparseClip norm) to skip the update, but then runs
``grad_norm = torch.tensor(0.0).cuda()``, which raises on a CPU-only build. We recompile
``train_step`` from its source with that one line using the trainer's device; if the
line is not there (fixed upstream) nothing is changed.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from fairseq import trainer as trainer_module
from fairseq.trainer import Trainer

_STOCK_LINE = "grad_norm = torch.tensor(0.0).cuda()"
_FIXED_LINE = "grad_norm = torch.tensor(0.0, device=self.device)"


def patch_overflow_on_cpu() -> None:
    """Install the fixed ``train_step`` (idempotent)."""
    if getattr(Trainer.train_step, "_ts_cpu_overflow", False):
        return
    original = inspect.unwrap(Trainer.train_step)
    source = textwrap.dedent(inspect.getsource(original))
    if source.count(_STOCK_LINE) != 1:
        return
    tree = ast.parse(source.replace(_STOCK_LINE, _FIXED_LINE))
    ast.increment_lineno(tree, original.__code__.co_firstlineno - 1)
    namespace: dict = {}
    exec(compile(tree, inspect.getsourcefile(original), "exec"), vars(trainer_module), namespace)
    fixed = namespace["train_step"]
    fixed._ts_cpu_overflow = True
    Trainer.train_step = fixed
