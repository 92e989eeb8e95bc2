"""Fixes the plugin applies to stock fairseq 0.12 on current Python, NumPy and PyTorch.

Each file holds one fix and says what is broken upstream; :func:`apply_fairseq_fixes`
installs them all, in an order where later wrappers see the earlier ones.
"""

from __future__ import annotations

_APPLIED = False


def apply_fairseq_fixes() -> None:
    """Install every fix once (importing the plugin calls this)."""
    global _APPLIED
    if _APPLIED:
        return
    from torchscale_fairseq.compat.batching import patch_batching
    from torchscale_fairseq.compat.checkpoint_reads import patch_checkpoint_reads
    from torchscale_fairseq.compat.checkpoint_writes import patch_checkpoint_writes
    from torchscale_fairseq.compat.cpu_overflow import patch_overflow_on_cpu
    from torchscale_fairseq.compat.distributed_cpu import patch_fairseq_distributed
    from torchscale_fairseq.compat.expert_checkpoints import patch_trainer_expert_checkpoints
    from torchscale_fairseq.compat.expert_choice_generation import patch_build_generator
    from torchscale_fairseq.compat.expert_ddp import patch_distributed_wrapper
    from torchscale_fairseq.compat.model_parallel_init import patch_fairseq_model_parallel
    from torchscale_fairseq.compat.ngram_repeat_block import patch_ngram_repeat_block
    from torchscale_fairseq.compat.nonfinite_skip import patch_nonfinite_skip
    from torchscale_fairseq.compat.numpy2 import patch_numpy_compat
    from torchscale_fairseq.compat.safe_checkpoints import register_safe_globals
    from torchscale_fairseq.errors import install_excepthook

    patch_numpy_compat()
    patch_batching()
    patch_ngram_repeat_block()
    patch_checkpoint_writes()
    patch_nonfinite_skip()
    register_safe_globals()
    patch_fairseq_distributed()
    patch_fairseq_model_parallel()
    install_excepthook()
    patch_trainer_expert_checkpoints()
    patch_overflow_on_cpu()
    patch_distributed_wrapper()
    patch_build_generator()
    patch_checkpoint_reads()  # last: wraps the checkpoint loader the patches above installed
    _APPLIED = True
