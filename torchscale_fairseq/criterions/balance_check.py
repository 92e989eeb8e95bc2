"""Training an MoE model needs a criterion that adds the balance loss: without it nothing
keeps the routers from sending every token to a few experts. One-line error otherwise,
unless the user asks for it (``--moe-allow-no-balance-loss``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.moe.layer import MoELayer

BASES = {
    "moe_cross_entropy": "cross_entropy",
    "moe_label_smoothed_cross_entropy": "label_smoothed_cross_entropy",
    "moe_masked_lm": "masked_lm",
}


def check_balance_loss_criterion(model: nn.Module, criterion: nn.Module, criterion_name: str,
                                 model_cfg: Any) -> None:
    """Raise :class:`TsConfigError` when ``model`` has token-choice MoE layers (expert
    choice has no balance loss) and ``criterion`` does not add their balance loss."""
    if getattr(criterion, "adds_moe_balance_loss", False) or getattr(model_cfg, "moe_allow_no_balance_loss", False):
        return
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.cfg.router != "expert_choice"]
    if not layers:
        return
    variants = [moe for moe, base in BASES.items() if base == criterion_name] or list(BASES)
    raise TsConfigError(
        f"--moe-expert-count {layers[0].cfg.expert_count} with --criterion {criterion_name} trains the MoE layers "
        f"without their balance loss: use --criterion {' or '.join(variants)} (--moe-gate-loss-wt sets its weight), "
        "or pass --moe-allow-no-balance-loss to train without it"
    )
