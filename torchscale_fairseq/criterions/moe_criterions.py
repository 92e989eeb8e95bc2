"""``moe_cross_entropy``, ``moe_label_smoothed_cross_entropy``, ``moe_masked_lm``:
fairseq's ``cross_entropy``, ``label_smoothed_cross_entropy`` and ``masked_lm`` (their
flags; computed vocabulary-parallel under tensor parallelism, :mod:`.vocab_parallel`)
plus ``--moe-gate-loss-wt`` times the balance loss and ``--moe-z-loss-wt`` times the router
z-loss (:mod:`.moe_terms`)."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass

from fairseq.criterions import CRITERION_DATACLASS_REGISTRY, register_criterion

from torchscale_fairseq.criterions import vocab_parallel
from torchscale_fairseq.criterions.balance_check import BASES
from torchscale_fairseq.criterions.moe_terms import OutputRecorder, add_moe_terms, moe_outputs, reduce_moe_metrics
from torchscale_fairseq.errors import TsConfigError

GATE_LOSS_WT = 0.01  # X-MoE / GShard
Z_LOSS_WT = 0.0  # off; ST-MoE uses 0.001


def _make(name: str, base_name: str) -> type:
    base = vocab_parallel.REPLACEMENTS[base_name]
    base_cfg = CRITERION_DATACLASS_REGISTRY[base_name]
    cfg_cls = dataclass(make_dataclass(
        f"{base_cfg.__name__}Moe",
        [("moe_gate_loss_wt", float, field(default=GATE_LOSS_WT, metadata={"help": "weight of the MoE balance loss"})),
         ("moe_z_loss_wt", float, field(default=Z_LOSS_WT, metadata={
             "help": "weight of the router z-loss (ST-MoE; Megatron-core --moe-z-loss-coeff); 0 = off"}))],
        bases=(base_cfg,),
    ))

    def build_criterion(cls, cfg, task):
        for flag, value in (("--moe-gate-loss-wt", cfg.moe_gate_loss_wt), ("--moe-z-loss-wt", cfg.moe_z_loss_wt)):
            if value < 0:
                raise TsConfigError(f"{flag} {value} is negative: use 0 (off) or a positive weight")
        criterion = super(cls, cls).build_criterion(cfg, task)
        criterion.moe_gate_loss_wt, criterion.moe_z_loss_wt = cfg.moe_gate_loss_wt, cfg.moe_z_loss_wt
        return criterion

    def forward(self, model, sample, reduce=True):
        recorder = OutputRecorder(model)
        loss, sample_size, logging_output = base.forward(self, recorder, sample, reduce)
        layers = moe_outputs(recorder.outputs[-1], name)
        loss = add_moe_terms(layers, self.moe_gate_loss_wt, self.moe_z_loss_wt, loss, sample_size, logging_output)
        return loss, sample_size, logging_output

    def reduce_metrics(cls, logging_outputs) -> None:
        base.reduce_metrics(logging_outputs)
        reduce_moe_metrics(logging_outputs)

    cls = type(
        f"Moe{base.__name__}", (base,),
        {"build_criterion": classmethod(build_criterion), "forward": forward, "adds_moe_balance_loss": True,
         "moe_gate_loss_wt": GATE_LOSS_WT, "moe_z_loss_wt": Z_LOSS_WT,  # for criteria built without build_criterion
         "reduce_metrics": classmethod(reduce_metrics),
         "__doc__": f"``{base_name}`` plus the MoE balance loss and router z-loss."},
    )
    return register_criterion(name, dataclass=cfg_cls)(cls)


for _name, _base in BASES.items():
    _make(_name, _base)
