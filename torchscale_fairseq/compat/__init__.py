"""Fixes of upstream bugs in stock fairseq (0.12.2 / fairseq-fixed 0.12.3.1) on current
Python, NumPy and PyTorch, and in PyTorch itself where the plugin meets them; nothing else.
Each file holds one fix and names the bug and the versions it applies to. The plugin's
features touch fairseq in :mod:`torchscale_fairseq.integration`.
"""

from __future__ import annotations

from torchscale_fairseq.compat.batching import patch_batching
from torchscale_fairseq.compat.checkpoint_writes import patch_checkpoint_writes
from torchscale_fairseq.compat.cpu_mixed_precision import patch_cpu_mixed_precision
from torchscale_fairseq.compat.dataloader_worker_tempdir import patch_dataloader_worker_tempdir
from torchscale_fairseq.compat.distributed_cpu import patch_fairseq_distributed
from torchscale_fairseq.compat.distributed_nn_defaults import patch_distributed_nn_defaults
from torchscale_fairseq.compat.ngram_repeat_block import patch_ngram_repeat_block
from torchscale_fairseq.compat.numpy2 import patch_numpy_compat
from torchscale_fairseq.compat.prefetch_thread_exit import patch_prefetch_thread_exit
from torchscale_fairseq.compat.safe_checkpoints import register_safe_globals
from torchscale_fairseq.compat.save_dir_check import patch_save_dir_check


def apply_fairseq_fixes() -> None:
    """Install every fix (importing the plugin calls this once)."""
    patch_numpy_compat()
    patch_batching()
    patch_ngram_repeat_block()
    patch_checkpoint_writes()
    patch_save_dir_check()
    register_safe_globals()
    patch_fairseq_distributed()
    patch_cpu_mixed_precision()
    patch_prefetch_thread_exit()
    patch_dataloader_worker_tempdir()
    patch_distributed_nn_defaults()
