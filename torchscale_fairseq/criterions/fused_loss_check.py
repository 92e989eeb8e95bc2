"""Where ``--ts-fused-cross-entropy`` can run, checked before any step."""

from __future__ import annotations

from typing import Any

from torchscale_fairseq.criterions import vocab_parallel
from torchscale_fairseq.errors import TsConfigError


def check_fused_loss_run(model: Any, criterion: Any, cfg: Any) -> None:
    """``--ts-fused-cross-entropy`` runs where its loss is computed: with the criterions that call the
    decoder's ``output_loss``, and where the output weight may be used after the wrapped forward
    (not with DDP's ``--find-unused-parameters``, nor a sharded data-parallel wrapper)."""
    if not getattr(getattr(model, "decoder", None), "fuses_output_loss", False):
        return
    if not isinstance(criterion, vocab_parallel.CrossEntropyCriterion):
        raise TsConfigError(
            f"--ts-fused-cross-entropy computes the loss in the criterions cross_entropy and moe_cross_entropy, not "
            f"--criterion {cfg.criterion._name}: use one of those or drop the flag"
        )
    if cfg.distributed_training.find_unused_parameters or cfg.distributed_training.ddp_backend == "fully_sharded":
        raise TsConfigError(
            "--ts-fused-cross-entropy uses the output weight after the model's forward, which DDP's "
            "--find-unused-parameters and --ddp-backend fully_sharded do not allow: drop one of the two"
        )
