"""Run fairseq-train with NaN gradients injected at one update; print per-step records.

Usage: python inject_nonfinite.py STEP <fairseq-train args...>   (STEP+: at every call from STEP on;
STEP@R: on distributed rank R only)
Each trainer ``train_step`` call prints ``STEP {json}`` with the update counter, a
checksum of the parameters, the fp16 loss scale, a checksum of the optimizer's state (moments
and step counts) and the MoE layers' expert biases before and after the call. Logged meters are
not rounded (:mod:`unrounded_cli`).
"""

import json
import sys

import torch
from fairseq.tasks.fairseq_task import FairseqTask
from fairseq_cli.train import cli_main
from unrounded_cli import unround_meters

import torchscale_fairseq  # noqa: F401  (installs the plugin before fairseq runs)
from torchscale_fairseq.integration.trainer import TsTrainer

_AT, _, _RANK = sys.argv.pop(1).partition("@")
INJECT_AT, INJECT_ON = int(_AT.rstrip("+")), _AT.endswith("+")
_calls = {"n": 0}
_task_train_step = FairseqTask.train_step
_trainer_train_step = TsTrainer.train_step
_run_schedule = TsTrainer._run_schedule


def task_train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
    out = _task_train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad, **kwargs)
    if _injected():
        _fill_nan(model)
    return out


def run_schedule(self, samples, training):
    """The pipeline's step (its micro-batches do not pass through the task's ``train_step``)."""
    out = _run_schedule(self, samples, training)
    if training and _injected():
        _fill_nan(self.model)
    return out


def _fill_nan(model) -> None:
    next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))


def _injected() -> bool:
    on_this_rank = not _RANK or int(_RANK) == (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
    return on_this_rank and (_calls["n"] == INJECT_AT or (INJECT_ON and _calls["n"] > INJECT_AT))


def _checksum(trainer) -> float:
    return float(sum(p.detach().double().sum() for p in trainer.model.parameters()))


def _state_checksum(trainer) -> float:
    state = trainer.optimizer.optimizer.state.values()
    return float(sum(v.double().sum() if torch.is_tensor(v) else v for s in state for v in s.values()
                     if torch.is_tensor(v) or isinstance(v, (int, float))))


def _expert_biases(trainer) -> list[float]:
    return [v for name, b in trainer.model.named_buffers() if name.endswith("expert_bias") for v in b.tolist()]


def _scale(trainer):
    scaler = getattr(trainer.optimizer, "scaler", None)
    return None if scaler is None else float(scaler.loss_scale)


def trainer_train_step(self, samples, raise_oom=False):
    before = (self.get_num_updates(), _checksum(self), _scale(self), _state_checksum(self), _expert_biases(self))
    out = _trainer_train_step(self, samples, raise_oom)
    after = (self.get_num_updates(), _checksum(self), _scale(self), _state_checksum(self), _expert_biases(self))
    print("STEP " + json.dumps({"call": _calls["n"], "injected": _injected(), "before": before,
                                "after": after}), flush=True)
    _calls["n"] += 1
    return out


FairseqTask.train_step = task_train_step
TsTrainer.train_step = trainer_train_step
TsTrainer._run_schedule = run_schedule

if __name__ == "__main__":
    unround_meters()
    sys.argv[0] = "fairseq-train"
    cli_main()
