"""``moe_cross_entropy``, ``moe_label_smoothed_cross_entropy``, ``moe_masked_lm``: the
registered ``cross_entropy``, ``label_smoothed_cross_entropy`` and ``masked_lm`` (their
flags, and the vocabulary-parallel versions when those are installed first) plus
``--moe-gate-loss-wt`` times the balance loss (:mod:`.moe_terms`)."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass

from fairseq.criterions import (
    CRITERION_DATACLASS_REGISTRY,
    CRITERION_REGISTRY,
    register_criterion,
)

from torchscale_fairseq.criterions.moe_terms import add_moe_terms, reduce_moe_metrics

BASES = {
    "moe_cross_entropy": "cross_entropy",
    "moe_label_smoothed_cross_entropy": "label_smoothed_cross_entropy",
    "moe_masked_lm": "masked_lm",
}


def _make(name: str, base_name: str) -> type:
    base = CRITERION_REGISTRY[base_name]
    base_cfg = CRITERION_DATACLASS_REGISTRY[base_name]
    cfg_cls = dataclass(make_dataclass(
        f"{base_cfg.__name__}Moe",
        [("moe_gate_loss_wt", float, field(default=0.01, metadata={"help": "weight of the MoE balance loss"}))],
        bases=(base_cfg,),
    ))

    def build_criterion(cls, cfg, task):
        criterion = super(cls, cls).build_criterion(cfg, task)
        criterion.moe_gate_loss_wt = cfg.moe_gate_loss_wt
        return criterion

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = base.forward(self, model, sample, reduce)
        loss = add_moe_terms(model, name, self.moe_gate_loss_wt, loss, sample_size, logging_output)
        return loss, sample_size, logging_output

    def reduce_metrics(cls, logging_outputs) -> None:
        base.reduce_metrics(logging_outputs)
        reduce_moe_metrics(logging_outputs)

    cls = type(
        f"Moe{base.__name__}", (base,),
        {"build_criterion": classmethod(build_criterion), "forward": forward,
         "reduce_metrics": classmethod(reduce_metrics), "__doc__": f"``{base_name}`` plus the MoE balance loss."},
    )
    return register_criterion(name, dataclass=cfg_cls)(cls)


for _name, _base in BASES.items():
    _make(_name, _base)
