"""``moe_cross_entropy``, ``moe_label_smoothed_cross_entropy``, ``moe_masked_lm``:
fairseq's ``cross_entropy``, ``label_smoothed_cross_entropy`` and ``masked_lm`` (their
flags; computed vocabulary-parallel under tensor parallelism, :mod:`.vocab_parallel`)
plus ``--moe-gate-loss-wt`` times the balance loss (:mod:`.moe_terms`)."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass

from fairseq.criterions import CRITERION_DATACLASS_REGISTRY, register_criterion

from torchscale_fairseq.criterions import vocab_parallel
from torchscale_fairseq.criterions.balance_check import BASES
from torchscale_fairseq.criterions.moe_terms import OutputRecorder, add_moe_terms, moe_outputs, reduce_moe_metrics


def _make(name: str, base_name: str) -> type:
    base = vocab_parallel.REPLACEMENTS[base_name]
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
        recorder = OutputRecorder(model)
        loss, sample_size, logging_output = base.forward(self, recorder, sample, reduce)
        layers = moe_outputs(recorder.outputs[-1], name)
        loss = add_moe_terms(layers, self.moe_gate_loss_wt, loss, sample_size, logging_output)
        return loss, sample_size, logging_output

    def reduce_metrics(cls, logging_outputs) -> None:
        base.reduce_metrics(logging_outputs)
        reduce_moe_metrics(logging_outputs)

    cls = type(
        f"Moe{base.__name__}", (base,),
        {"build_criterion": classmethod(build_criterion), "forward": forward, "adds_moe_balance_loss": True,
         "reduce_metrics": classmethod(reduce_metrics), "__doc__": f"``{base_name}`` plus the MoE balance loss."},
    )
    return register_criterion(name, dataclass=cfg_cls)(cls)


for _name, _base in BASES.items():
    _make(_name, _base)
