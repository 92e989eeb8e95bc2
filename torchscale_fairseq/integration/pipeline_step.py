"""One update (or validation batch) of a pipeline-parallel run inside fairseq's
``Trainer.train_step`` / ``valid_step``.

fairseq's step calls ``task.train_step`` once per ``--update-freq`` micro-batch, forward and
backward together; a pipeline interleaves the micro-batches' forwards and backwards across
stages. :class:`ScheduledTask` stands in for the task during the step: its first
``train_step`` (or ``valid_step``) call runs the whole schedule
(:func:`run_pipeline_schedule`), after fairseq zeroed the gradients and set the seed, and every
call returns its micro-batch's ``(loss, sample_size, logging output)``; the rest of fairseq's
step (data-parallel all-reduce, the ``1 / sample_size`` scaling, clipping, the optimizer step,
logging) runs unchanged. The losses and logging outputs exist on the last stage; they are
shared with the pipeline's other stages, so every stage scales, clips and logs as one process.

MoE layers on other stages: their auxiliary terms (``w S sum_l L_l + w_z S_r sum_l Z_l``,
:func:`~torchscale_fairseq.criterions.moe_terms.add_moe_terms`) are differentiated with the
stage's output in its backward, ``S`` (the micro-batch's sample size, which the criterion computes
on the last stage) travelling back with the gradients; their logged figures join the last
stage's logging output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from fairseq import utils

from torchscale_fairseq.criterions.moe_terms import add_moe_terms
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.pipeline_parallel import PipelineChannel, run_steps, sum_tied_grads
from torchscale_fairseq.model_parallel.pipeline_schedules import forward_only_steps, schedule_steps

StepResult = tuple[Any, Any, dict]  # (loss, sample_size, logging output) as task.train_step returns them


class ScheduledTask:
    """The task, whose ``train_step`` / ``valid_step`` return the results of ``run()`` (called once,
    at the first of them) in micro-batch order."""

    def __init__(self, task: Any, run: Callable[[], list[StepResult]]) -> None:
        self._task, self._run = task, run
        self._results: Iterator[StepResult] | None = None

    def train_step(self, *args: Any, **kwargs: Any) -> StepResult:
        if self._results is None:
            self._results = iter(self._run())
        return next(self._results)

    valid_step = train_step

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # fairseq reads class-level hooks from task.__class__
        return type(self._task)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


def _loss_scale(optimizer: Any) -> float:
    """What the optimizer's ``backward`` multiplies the loss by (fp16 / AMP loss scaling)."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None:
        return 1.0
    return float(scaler.get_scale() if hasattr(scaler, "get_scale") else scaler.loss_scale)


def merge_moe_figures(logging_output: dict, figures: dict) -> None:
    """Add another stage's MoE figures (:func:`add_moe_terms`) to the last stage's logging output:
    sums, the per-layer load CVs side by side."""
    for key, value in figures.items():
        if key.startswith("moe_cv_") or key == "moe_layers":
            logging_output[key] = value
        elif key.startswith("moe_"):
            logging_output[key] = logging_output.get(key, 0) + value


def _share(parallel: Any, value: Any) -> list[Any]:
    """``value`` of every stage of this rank's pipeline, in stage order."""
    shared: list[Any] = [None] * parallel.pipeline_size
    dist.all_gather_object(shared, value, group=parallel.pipeline_group)
    return shared


def run_pipeline_schedule(trainer: Any, samples: list[Any], training: bool) -> list[StepResult]:
    """Every micro-batch of ``samples`` through this rank's chunks in the schedule's order (backward
    too when ``training``: gradients accumulate in the parameters, the tied embedding's summed over
    its first and last stage); the results of the last stage, with every stage's MoE figures, on
    every stage."""
    parallel, model, criterion, cfg = trainer.parallel, trainer.model, trainer.criterion, trainer.cfg
    stack = trainer.get_model().pipeline_stack  # ts_lm's decoder, ts_mlm's encoder
    split = stack.split
    prepared = [trainer._prepare_sample(sample) for sample in samples]
    results: list[tuple[Any, dict] | None] = [None] * len(samples)
    moe: dict[tuple[int, int], list] = {}  # (chunk, micro-batch) -> MoE outputs of a stage before the last
    figures: list[dict] = [{} for _ in samples]
    weights = (getattr(criterion, "moe_gate_loss_wt", 0.0), getattr(criterion, "moe_z_loss_wt", 0.0))

    def forward(chunk: int, i: int, hidden: torch.Tensor | None) -> torch.Tensor:
        sample, is_dummy = prepared[i]
        stack.set_pipeline_input(chunk, hidden)
        with torch.autocast("cuda", enabled=bool(cfg.common.amp) and trainer.device.type == "cuda"):
            if not split.is_last(chunk):
                out, extra = model(**sample["net_input"])
                if extra.get("moe"):
                    moe[chunk, i] = extra["moe"]
                return out
            loss, sample_size, logging_output = criterion(model, sample)
        results[i] = (sample_size, logging_output)
        return loss * 0 if is_dummy else loss  # fairseq's ignore_grad

    def backward_loss(i: int, loss: torch.Tensor) -> int:
        trainer.optimizer.backward(loss)
        return int(results[i][0])

    def stage_loss(chunk: int, i: int, sample_size: int) -> torch.Tensor | None:
        layers = moe.pop((chunk, i), None)
        if not layers:
            return None
        zero = torch.zeros((), device=layers[0].balance_loss.device)
        term = add_moe_terms(layers, *weights, zero, sample_size, stage_figures := {})
        merge_moe_figures(figures[i], stage_figures)
        scale = 0.0 if prepared[i][1] else _loss_scale(trainer.optimizer)
        return term * scale if any(weights) else None

    channel = PipelineChannel(parallel.pipeline_ranks, parallel.pipeline_group, trainer.device)
    if training:
        trainer.get_model().set_num_updates(trainer.get_num_updates())
        steps = schedule_steps(str(cfg.model.pipeline_schedule), parallel.pipeline_size, parallel.pipeline_rank,
                               len(samples), split.chunks)
        run_steps(steps, channel, parallel.pipeline_rank, split.chunks, forward, backward_loss, stage_loss)
        sum_tied_grads(trainer.get_model().parameters(), parallel.embedding_group)
    else:
        with torch.no_grad():
            run_steps(forward_only_steps(len(samples), split.chunks), channel, parallel.pipeline_rank, split.chunks,
                      forward)
    last_results = _share(parallel, utils.move_to_cpu(results) if split.holds_last_stage else None)[-1]
    if not training:  # the MoE figures of the other stages, with the sample sizes the last stage computed
        with torch.no_grad():
            for (_, i), layers in sorted(moe.items(), key=lambda item: item[0]):
                zero = torch.zeros((), device=layers[0].balance_loss.device)
                add_moe_terms(layers, *weights, zero, last_results[i][0], stage_figures := {})
                merge_moe_figures(figures[i], stage_figures)
    if stack.cfg.moe is not None:  # (on every stage: a collective; the last one's figures are its other chunks')
        for stage_figures in _share(parallel, figures):
            for i, figure in enumerate(stage_figures):
                merge_moe_figures(last_results[i][1], figure)
    zero = torch.zeros((), device=trainer.device)
    return [(zero, sample_size, logging_output) for sample_size, logging_output in last_results]


def check_pipeline_run(cfg: Any, data_parallel_size: int, pipeline_size: int) -> None:
    """What a pipeline-parallel run cannot honour, refused in one line before any step."""
    backend = cfg.distributed_training.ddp_backend
    if data_parallel_size > 1 and backend not in ("legacy_ddp", "no_c10d"):
        raise TsConfigError(
            f"--ddp-backend {backend} all-reduces inside every backward, which a pipeline runs out of order: use "
            "--ddp-backend legacy_ddp with --pipeline-model-parallel-size > 1 and data parallelism"
        )
    chunks = cfg.model.virtual_pipeline_stages
    for update_freq in cfg.optimization.update_freq:
        if str(cfg.model.pipeline_schedule) == "1f1b" and update_freq < pipeline_size:
            raise TsConfigError(
                f"--update-freq {update_freq} gives each update fewer micro-batches than the {pipeline_size} pipeline "
                f"stages (most stages would idle): use --update-freq {pipeline_size} or more"
            )
        if chunks > 1 and update_freq % pipeline_size != 0:
            raise TsConfigError(
                f"--virtual-pipeline-stages {chunks} runs micro-batches in groups of the pipeline size "
                f"{pipeline_size}: use an --update-freq that is a multiple of it (not {update_freq})"
            )
