"""``moe_cross_entropy``, ``moe_label_smoothed_cross_entropy``, ``moe_masked_lm``:
fairseq's ``cross_entropy``, ``label_smoothed_cross_entropy`` and ``masked_lm`` (their
flags; computed vocabulary-parallel under tensor parallelism, :mod:`.vocab_parallel`)
plus ``--moe-gate-loss-wt`` times the balance loss and ``--moe-z-loss-wt`` times the router
z-loss (:mod:`.moe_terms`).

Each criterion is :class:`MoeCriterionMixin` over the :mod:`.vocab_parallel` class that
replaces its base in fairseq's registry, and its config is :class:`MoeLossConfig` over the
base's fairseq config (:data:`.balance_check.BASES` names the pairs)."""

# No ``from __future__ import annotations``: fairseq builds the flags from the config fields'
# types and rejects them as strings.
from dataclasses import dataclass, field
from typing import ClassVar

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterionConfig
from fairseq.criterions.masked_lm import MaskedLmConfig
from fairseq.dataclass import FairseqDataclass

from torchscale_fairseq.criterions import vocab_parallel
from torchscale_fairseq.criterions.moe_terms import OutputRecorder, moe_figures, moe_outputs, reduce_moe_metrics
from torchscale_fairseq.errors import TsConfigError

GATE_LOSS_WT = 0.01  # X-MoE / GShard
Z_LOSS_WT = 0.0  # off; ST-MoE uses 0.001


@dataclass
class MoeLossConfig(FairseqDataclass):
    """The MoE criteria's own flags. Listed first among a config's bases, so that its
    fields come after the base criterion's (dataclass fields follow the reversed MRO)."""

    moe_gate_loss_wt: float = field(default=GATE_LOSS_WT, metadata={"help": "weight of the MoE balance loss"})
    moe_z_loss_wt: float = field(default=Z_LOSS_WT, metadata={
        "help": "weight of the router z-loss (ST-MoE; Megatron-core --moe-z-loss-coeff); 0 = off"})


class MoeCriterionMixin:
    """What a MoE criterion adds to its base criterion (the next class in its MRO): the
    weights from :class:`MoeLossConfig` (the trainer scales the MoE layers' auxiliary losses with
    them, :mod:`torchscale_fairseq.modules.moe.aux_loss`), the MoE figures in :meth:`forward` and
    their metrics."""

    registry_name: ClassVar[str]  # the --criterion name, for error messages
    adds_moe_balance_loss: ClassVar[bool] = True  # read by balance_check
    # for criteria built without build_criterion
    moe_gate_loss_wt: float = GATE_LOSS_WT
    moe_z_loss_wt: float = Z_LOSS_WT

    @classmethod
    def build_criterion(cls, cfg, task):
        for flag, value in (("--moe-gate-loss-wt", cfg.moe_gate_loss_wt), ("--moe-z-loss-wt", cfg.moe_z_loss_wt)):
            if value < 0:
                raise TsConfigError(f"{flag} {value} is negative: use 0 (off) or a positive weight")
        criterion = super().build_criterion(cfg, task)
        criterion.moe_gate_loss_wt, criterion.moe_z_loss_wt = cfg.moe_gate_loss_wt, cfg.moe_z_loss_wt
        return criterion

    def forward(self, model, sample, reduce=True):
        recorder = OutputRecorder(model)
        loss, sample_size, logging_output = super().forward(recorder, sample, reduce)
        moe_figures(moe_outputs(recorder.outputs[-1], self.registry_name), sample_size, logging_output)
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_moe_metrics(logging_outputs)


@dataclass
class MoeCrossEntropyCriterionConfig(MoeLossConfig, CrossEntropyCriterionConfig):
    """``cross_entropy``'s config plus the MoE loss weights."""


@register_criterion("moe_cross_entropy", dataclass=MoeCrossEntropyCriterionConfig)
class MoeCrossEntropyCriterion(MoeCriterionMixin, vocab_parallel.CrossEntropyCriterion):
    """``cross_entropy`` plus the MoE balance loss and router z-loss."""

    registry_name = "moe_cross_entropy"


@dataclass
class MoeLabelSmoothedCrossEntropyCriterionConfig(MoeLossConfig, LabelSmoothedCrossEntropyCriterionConfig):
    """``label_smoothed_cross_entropy``'s config plus the MoE loss weights."""


@register_criterion("moe_label_smoothed_cross_entropy", dataclass=MoeLabelSmoothedCrossEntropyCriterionConfig)
class MoeLabelSmoothedCrossEntropyCriterion(MoeCriterionMixin, vocab_parallel.LabelSmoothedCrossEntropyCriterion):
    """``label_smoothed_cross_entropy`` plus the MoE balance loss and router z-loss."""

    registry_name = "moe_label_smoothed_cross_entropy"


@dataclass
class MoeMaskedLmConfig(MoeLossConfig, MaskedLmConfig):
    """``masked_lm``'s config plus the MoE loss weights."""


@register_criterion("moe_masked_lm", dataclass=MoeMaskedLmConfig)
class MoeMaskedLmLoss(MoeCriterionMixin, vocab_parallel.MaskedLmLoss):
    """``masked_lm`` plus the MoE balance loss and router z-loss."""

    registry_name = "moe_masked_lm"
