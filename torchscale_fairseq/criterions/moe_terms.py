"""What every MoE criterion adds to its base loss, and what it logs.

``loss = base + w * S * sum_l L_l + w_z * S_r * sum_l Z_l`` (the terms are differentiated inside the
MoE layers, :mod:`torchscale_fairseq.modules.moe.aux_loss`; the criterion returns the base loss)
with ``w`` = ``--moe-gate-loss-wt`` (paper: 0.01), ``L_l`` the balance loss of MoE layer ``l`` and
``S`` the sample size of the global batch (fairseq divides the summed gradients by it, so the
balance term keeps weight ``w`` whatever the batch); ``w_z`` = ``--moe-z-loss-wt`` (ST-MoE: 0.001;
default 0, off), ``Z_l`` the layer's router z-loss (the mean over this rank's tokens,
:func:`~torchscale_fairseq.modules.moe.balance.router_z_loss`) and ``S_r`` this rank's sample size,
so that every token's z-loss weighs the same in any data-parallel layout. Under context parallelism
"this rank's" micro-batch is its context-parallel group's (each rank holds chunks of it): ``S`` and
``S_r`` are the whole micro-batch's, ``L_l`` and ``Z_l`` this rank's shares of the group's
(:mod:`torchscale_fairseq.modules.moe.balance`), so the terms and figures add up to ``C = 1``'s. With ``--moe-balance-scope
local`` (default) ``L_l`` and ``S`` are this rank's, as in fairseq's MoE branch; with ``global``
``L_l`` is this rank's share of the data-parallel group's loss
(:mod:`torchscale_fairseq.modules.moe.balance`) and ``S`` is summed over the group (by the trainer,
before the update's forwards). The MoE layers return their ``L_l`` and statistics
(:class:`~torchscale_fairseq.modules.moe.balance.MoEAux`) and the model passes them up in its extra
output under ``"moe"``; the criterion reads them from the output the model returned to its base loss
(:class:`OutputRecorder`). The reported ``loss``/``ppl`` stay the base ones; ``moe_gate_loss``
(``sum_l L_l``), ``moe_z_loss`` (``sum_l Z_l``, whatever ``w_z``), per-layer expert load CV
(``moe_cv_<layer>``), ``moe_drop`` (fraction of dropped assignments) and ``moe_entropy`` (mean
routing entropy per token, nats) are logged beside them.
"""

from __future__ import annotations

from typing import Any

import torch
from fairseq.criterions import masked_lm
from fairseq.logging import metrics

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.moe.balance import MoEAux


class OutputRecorder:
    """The model as a base criterion sees it, keeping what each of its calls returned."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.outputs: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        self.outputs.append(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def moe_outputs(net_output: Any, criterion: str) -> list[MoEAux]:
    """The MoE layers' outputs in a model's extra output (empty for a dense ts model);
    one-line error for a model that does not report them."""
    extra = net_output[1] if isinstance(net_output, (tuple, list)) and len(net_output) > 1 else None
    if not isinstance(extra, dict) or "moe" not in extra:
        raise TsConfigError(
            f"--criterion {criterion} needs a model with MoE-aware outputs (ts_lm, ts_transformer, ts_mlm); "
            f"this model reports none: use a ts model or the plain criterion"
        )
    return extra["moe"]


def criterion_sample_size(criterion: Any, sample: dict) -> Any:
    """The sample size ``criterion`` returns for ``sample``, known before its forward (fairseq's rules:
    ``masked_lm`` the masked tokens, a 0-d tensor; the others the sentences with ``--sentence-avg``,
    else the target tokens)."""
    if isinstance(criterion, masked_lm.MaskedLmLoss):
        return sample["target"].ne(criterion.padding_idx).int().sum()
    return sample["target"].size(0) if getattr(criterion, "sentence_avg", False) else sample["ntokens"]


def moe_figures(layers: list[MoEAux], sample_size: Any, logging_output: dict) -> None:
    """Fill ``logging_output`` with the MoE figures of ``layers``: ``moe_gate_loss`` = ``S sum_l L_l``
    (``S`` from the layers' :class:`~torchscale_fairseq.modules.moe.aux_loss.AuxLossScale`, summed over
    the data-parallel group under the global balance scope; ``sample_size`` when none was set),
    ``moe_z_loss`` = ``S_r sum_l Z_l`` (``S_r`` the scale's, the micro-batch's under context parallelism),
    the per-layer load CVs, drops and routing entropy."""
    if not layers:
        logging_output["moe_gate_loss"] = logging_output["moe_z_loss"] = 0.0
        return
    gate = torch.stack([m.balance_loss.detach().float() for m in layers]).sum()
    z = torch.stack([m.z_loss.detach().float() for m in layers]).sum()
    scale = layers[0].scale
    local = torch.as_tensor(sample_size if scale is None else scale.sample_size, dtype=torch.float32,
                            device=gate.device)
    total = local if scale is None else scale.balance_sample_size.to(gate.device)
    figures = torch.cat([  # the layers' statistics are device tensors: one host read for all of them
        torch.stack([gate * total, z * local]),
        torch.stack([m.stats.load_cv for m in layers]).float().to(gate.device),
        torch.stack([torch.stack([m.stats.dropped, m.stats.routed, m.stats.tokens]).float()
                     for m in layers]).sum(0).to(gate.device),
        torch.stack([m.stats.entropy_sum for m in layers]).float().sum().unsqueeze(0).to(gate.device),
    ]).tolist()
    gate_sum, z_sum, *cvs, dropped, routed, tokens, entropy = figures
    logging_output["moe_gate_loss"], logging_output["moe_z_loss"] = gate_sum, z_sum
    logging_output["moe_layers"] = 1
    for m, cv in zip(layers, cvs):
        logging_output[f"moe_cv_{m.tag}"] = cv
    logging_output["moe_dropped"], logging_output["moe_routed"] = int(dropped), int(routed)
    logging_output["moe_entropy_sum"], logging_output["moe_tokens"] = entropy, int(tokens)


def merge_moe_figures(logging_output: dict, figures: dict) -> None:
    """Add another pipeline stage's MoE figures (:func:`moe_figures`) to the last stage's logging
    output: sums, the per-layer load CVs side by side."""
    for key, value in figures.items():
        if key.startswith("moe_cv_") or key == "moe_layers":
            logging_output[key] = value
        elif key.startswith("moe_"):
            logging_output[key] = logging_output.get(key, 0) + value


def reduce_moe_metrics(logging_outputs: list[dict]) -> None:
    def total(key: str) -> float:
        return sum(float(log.get(key, 0)) for log in logging_outputs)

    sample_size = total("sample_size")
    metrics.log_scalar("moe_gate_loss", total("moe_gate_loss") / max(sample_size, 1.0), sample_size, round=4)
    metrics.log_scalar("moe_z_loss", total("moe_z_loss") / max(sample_size, 1.0), sample_size, round=4)
    n = total("moe_layers")
    if n == 0:
        return
    for key in sorted({k for log in logging_outputs for k in log if k.startswith("moe_cv_")}):
        metrics.log_scalar(key, total(key) / n, n, round=3)
    metrics.log_scalar("moe_drop", total("moe_dropped") / max(total("moe_routed"), 1.0), n, round=4)
    metrics.log_scalar("moe_entropy", total("moe_entropy_sum") / max(total("moe_tokens"), 1.0), n, round=4)
