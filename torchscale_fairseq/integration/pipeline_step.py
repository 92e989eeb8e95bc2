"""How an update's micro-batches run, as overrides of fairseq's ``Trainer`` (:class:`ScheduledTrainer`,
the base of :class:`~torchscale_fairseq.integration.trainer.TsTrainer`).

- MoE auxiliary losses: before an update, the scale of each micro-batch's balance and z-losses
  (:func:`~torchscale_fairseq.modules.moe.aux_loss.aux_loss_scales`: ``w S`` and ``w_z S_r`` times the
  loss scale, 0 for a dummy batch; ``S`` summed over the data-parallel group under
  ``--moe-balance-scope global``, one all-reduce for the update) follows from the sample sizes,
  which the criterion's rule gives before any forward; each is set on the MoE layers before its
  micro-batch's forward (in fairseq's loop when fairseq prepares the micro-batch).
- ``--pipeline-model-parallel-size``: the update runs its micro-batches through this rank's chunks
  in the schedule's order (:func:`~torchscale_fairseq.model_parallel.pipeline_parallel.run_steps`,
  which knows only hidden states and their gradients), then finishes as fairseq's ``train_step``
  does (the data-parallel all-reduce, the ``1 / sample_size`` scaling, clipping, the optimizer
  step, logging). The losses and logging outputs exist on the last stage; they are shared with
  the pipeline's other stages, with every stage's MoE figures, so every stage scales, clips and
  logs as one process.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from fairseq import utils
from fairseq.logging import metrics
from fairseq.trainer import Trainer

from torchscale_fairseq.choices import choice
from torchscale_fairseq.criterions.moe_terms import criterion_sample_size, merge_moe_figures, moe_figures
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.pipeline_parallel import PipelineChannel, run_steps, sum_tied_grads
from torchscale_fairseq.model_parallel.pipeline_schedules import forward_only_steps, schedule_steps
from torchscale_fairseq.modules.moe.aux_loss import AuxLossScale, aux_loss_scales, set_aux_loss_scale
from torchscale_fairseq.modules.moe.layer import MoELayer

logger = logging.getLogger(__name__)


def loss_scale(optimizer: Any) -> float:
    """What the optimizer's ``backward`` multiplies the loss by (fp16 / AMP loss scaling)."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None:
        return 1.0
    return float(scaler.get_scale() if hasattr(scaler, "get_scale") else scaler.loss_scale)


def activation_dtype(cfg: Any) -> torch.dtype:
    """The dtype of the hidden states between stages: the parameters' (``--amp`` keeps them fp32)."""
    if cfg.common.fp16 and not cfg.common.amp:
        return torch.float16
    if cfg.common.bf16 and not cfg.common.amp:
        return torch.bfloat16
    return torch.float32


def is_dummy(sample: Any) -> bool:
    """fairseq's test for a dummy batch (an empty one, stood in for by the first batch, gradient ignored)."""
    return sample is None or len(sample) == 0


class PipelineInput:
    """The model as the last stage's criterion calls it: each call runs chunk ``chunk`` on
    ``hidden``, the previous stage's hidden states."""

    def __init__(self, model: torch.nn.Module, chunk: int, hidden: torch.Tensor | None) -> None:
        self.model, self.chunk, self.hidden = model, chunk, hidden

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs, pipeline_chunk=self.chunk, pipeline_input=self.hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class ScheduledTrainer(Trainer):
    """fairseq's ``Trainer`` with the MoE auxiliary-loss scales and the pipeline schedule of the
    module docstring. ``self.parallel``: the run's parallel context (set by the subclass)."""

    parallel: Any
    _queued_scales: list[AuxLossScale]

    @property
    def moe_layers(self) -> list[MoELayer]:
        if not hasattr(self, "_moe_layers"):
            self._moe_layers = [m for m in self._model.modules() if isinstance(m, MoELayer)]
        return self._moe_layers

    def aux_loss_scales(self, samples: list[tuple[Any, bool]], training: bool) -> list[AuxLossScale] | None:
        """The scale of each ``(sample, is dummy)`` (``None`` without MoE layers); a dummy's sample
        size is the dummy batch's, as the criterion would compute it."""
        if not self.moe_layers:
            return None
        criterion = self.get_criterion()
        stand_in = samples[0][0] if isinstance(self._dummy_batch, str) else self._dummy_batch
        sizes = [criterion_sample_size(criterion, stand_in if dummy else sample) for sample, dummy in samples]
        global_scope = any(m.cfg.balance_scope == "global" for m in self.moe_layers)
        group = self.parallel.data_group if global_scope and self.parallel.data_size > 1 else None
        weights = (getattr(criterion, "moe_gate_loss_wt", 0.0), getattr(criterion, "moe_z_loss_wt", 0.0))
        scale = loss_scale(self.optimizer) if training else 1.0
        return aux_loss_scales(sizes, [dummy for _, dummy in samples], *weights, scale, self.device, group)

    def _prepare_sample(self, sample, is_dummy=False):
        """fairseq's; in fairseq's update loop the prepared micro-batch's MoE scale is set, in order."""
        prepared = super()._prepare_sample(sample, is_dummy)
        if not is_dummy and getattr(self, "_queued_scales", None):
            set_aux_loss_scale(self.moe_layers, self._queued_scales.pop(0))
        return prepared

    def _moe_samples(self, samples: list[Any]) -> list[tuple[Any, bool]]:
        """``(sample, is dummy)`` of fairseq's loop's micro-batches before it prepares them (the
        dummy batch is the first micro-batch fairseq prepared)."""
        return [(sample, is_dummy(sample)) for sample in samples]

    def train_step(self, samples, raise_oom: bool = False):
        if self.parallel.pipeline_size > 1:
            return self._pipeline_train_step(samples)
        if self.moe_layers and not (is_dummy(samples[0]) and isinstance(self._dummy_batch, str)):
            self._queued_scales = self.aux_loss_scales(self._moe_samples(samples), training=True)
        try:
            return super().train_step(samples, raise_oom)
        finally:
            self._queued_scales = []
            set_aux_loss_scale(self.moe_layers, None)

    @metrics.aggregate("valid")
    def valid_step(self, sample, raise_oom: bool = False):
        if self.parallel.pipeline_size > 1:
            return self._pipeline_valid_step(sample)
        if self.moe_layers and not (is_dummy(sample) and isinstance(self._dummy_batch, str)):
            set_aux_loss_scale(self.moe_layers, self.aux_loss_scales(self._moe_samples([sample]), training=False)[0])
        try:
            return super().valid_step(sample, raise_oom)
        finally:
            set_aux_loss_scale(self.moe_layers, None)

    # pipeline parallelism -----------------------------------------------------------------

    def _run_schedule(self, samples: list[Any], training: bool) -> list[tuple[Any, dict]]:
        """Every micro-batch of ``samples`` through this rank's chunks in the schedule's order
        (backward too when ``training``: gradients accumulate in the parameters, the tied
        embedding's summed over its first and last stage); the last stage's ``(sample size,
        logging output)`` of each, with every stage's MoE figures, on every stage."""
        parallel, model, criterion, cfg = self.parallel, self.model, self.criterion, self.cfg
        stack = self.get_model().pipeline_stack  # ts_lm's decoder, ts_mlm's encoder
        split = stack.split
        prepared = [self._prepare_sample(sample) for sample in samples]
        scales = self.aux_loss_scales(prepared, training)
        results: list[tuple[Any, dict] | None] = [None] * len(samples)
        moe: dict[tuple[int, int], list] = {}  # (chunk, micro-batch) -> MoE outputs of a stage before the last

        def forward(chunk: int, i: int, hidden: torch.Tensor | None) -> torch.Tensor:
            sample, dummy = prepared[i]
            if scales is not None:
                set_aux_loss_scale(self.moe_layers, scales[i])
            with torch.autocast("cuda", enabled=bool(cfg.common.amp) and self.device.type == "cuda"):
                if not split.is_last(chunk):
                    out, extra = model(**sample["net_input"], pipeline_chunk=chunk, pipeline_input=hidden)
                    if extra.get("moe"):
                        moe[chunk, i] = extra["moe"]
                    return out
                loss, sample_size, logging_output = criterion(PipelineInput(model, chunk, hidden), sample)
            results[i] = (sample_size, logging_output)
            return loss * 0 if dummy else loss  # fairseq's ignore_grad

        def backward(i: int, loss: torch.Tensor) -> None:
            self.optimizer.backward(loss)

        if not getattr(self, "_pipeline_group_used", False):
            # NCCL: the first batch_isend_irecv on a group must involve all its ranks, unless a collective came first
            dist.barrier(group=parallel.pipeline_group)
            self._pipeline_group_used = True
        shapes = [stack.hidden_shape(sample["net_input"]["src_tokens"]) for sample, _ in prepared]
        channel = PipelineChannel(parallel.pipeline_ranks, parallel.pipeline_group, self.device,
                                  activation_dtype(cfg), shapes.__getitem__)
        try:
            if training:
                self.get_model().set_num_updates(self.get_num_updates())
                steps = schedule_steps(choice(cfg.model, "pipeline_schedule", "1f1b"), parallel.pipeline_size,
                                       parallel.pipeline_rank, len(samples), split.chunks)
                run_steps(steps, channel, parallel.pipeline_rank, split.chunks, forward, backward)
                sum_tied_grads(self.get_model().parameters(), parallel.embedding_group)
            else:
                steps = forward_only_steps(parallel.pipeline_size, len(samples), split.chunks)
                run_steps(steps, channel, parallel.pipeline_rank, split.chunks, forward)
        finally:
            set_aux_loss_scale(self.moe_layers, None)
        figures: list[dict] = [{} for _ in samples]
        for (_, i), layers in sorted(moe.items(), key=lambda item: item[0]):
            moe_figures(layers, scales[i].sample_size, stage_figures := {})
            merge_moe_figures(figures[i], stage_figures)
        shared = [None] * parallel.pipeline_size
        mine = (utils.move_to_cpu(results) if split.holds_last_stage else None, figures if scales else None)
        dist.all_gather_object(shared, mine, group=parallel.pipeline_group)
        last_results = shared[-1][0]
        for _, stage_figures in shared:  # (the last stage's own figures are those of its other chunks)
            for i, figure in enumerate(stage_figures or []):
                merge_moe_figures(last_results[i][1], figure)
        return last_results

    def _pipeline_train_step(self, samples: list[Any]):
        """fairseq's ``train_step`` (its non-TPU path, without OOM recovery) with the micro-batches'
        forwards and backwards run by the pipeline schedule."""
        self._set_seed()
        self.model.train()
        self.criterion.train()
        self.zero_grad()
        metrics.log_start_time("train_wall", priority=800, round=0)
        results = self._run_schedule(samples, training=True)
        logging_outputs = [logging_output for _, logging_output in results]
        sample_size = sum(size for size, _ in results)
        ignore = is_dummy(samples[-1])
        if ignore:
            sample_size *= 0
        sample_size = sample_size.float() if torch.is_tensor(sample_size) else float(sample_size)
        if self._sync_stats():
            logging_outputs, (sample_size, _, total_train_time) = self._aggregate_logging_outputs(
                logging_outputs, sample_size, 0, self._local_cumulative_training_time(), ignore=ignore)
            self._cumulative_training_time = total_train_time / self.data_parallel_world_size
        self.optimizer.all_reduce_grads(self.model)
        numer = self.data_parallel_world_size if not self.cfg.optimization.use_bmuf or self._sync_stats() else 1
        self.optimizer.multiply_grads(numer / (sample_size or 1.0))
        grad_norm = self.clip_grad_norm(self.cfg.optimization.clip_norm)  # (a non-finite norm without --amp raises)
        self._check_grad_norms(grad_norm)
        overflow = bool(self.cfg.common.amp) and not bool(torch.isfinite(grad_norm).all())
        self.task.optimizer_step(self.optimizer, model=self.model, update_num=self.get_num_updates())
        logging_output = None
        if overflow:  # --amp: the scaler skipped the step; fairseq retries the batch
            if self._amp_retries == self.cfg.common.amp_batch_retries:
                logger.info("AMP: skipping this batch.")
                self._amp_retries = 0
            else:
                self._amp_retries += 1
                return self.train_step(samples)
        else:
            self.set_num_updates(self.get_num_updates() + 1)
            logging_output = self._reduce_and_log_stats(logging_outputs, sample_size, grad_norm)
        if self.cfg.common.fp16 or self.cfg.common.amp:
            scaler = self.optimizer.scaler
            metrics.log_scalar("loss_scale", scaler.loss_scale if self.cfg.common.fp16 else scaler.get_scale(),
                               priority=700, round=4, weight=0)
        metrics.log_stop_time("train_wall")
        return logging_output

    def _pipeline_valid_step(self, sample: Any):
        """fairseq's ``valid_step`` with the forward run through the stages."""
        with torch.no_grad():
            self.model.eval()
            self.criterion.eval()
            ((sample_size, logging_output),) = self._run_schedule([sample], training=False)
            ignore = is_dummy(sample)
            if ignore:
                sample_size *= 0
        logging_outputs = [logging_output]
        if self.data_parallel_world_size > 1:
            logging_outputs, (sample_size,) = self._aggregate_logging_outputs(logging_outputs, sample_size,
                                                                              ignore=ignore)
        return self._reduce_and_log_stats(logging_outputs, sample_size)


def check_pipeline_run(cfg: Any, data_parallel_size: int, pipeline_size: int) -> None:
    """What a pipeline-parallel run cannot honour, refused in one line before any step
    (``data_parallel_size``: the ranks gradients are averaged over, data x context parallel)."""
    backend = cfg.distributed_training.ddp_backend
    if data_parallel_size > 1 and backend not in ("legacy_ddp", "no_c10d"):
        raise TsConfigError(
            f"--ddp-backend {backend} all-reduces inside every backward, which a pipeline runs out of order: use "
            "--ddp-backend legacy_ddp with --pipeline-model-parallel-size > 1 and data or context parallelism"
        )
    if cfg.ema.store_ema:
        raise TsConfigError("--store-ema is not pipeline-parallel: drop it or use --pipeline-model-parallel-size 1")
    chunks = cfg.model.virtual_pipeline_stages
    for update_freq in cfg.optimization.update_freq:
        if choice(cfg.model, "pipeline_schedule", "1f1b") == "1f1b" and update_freq < pipeline_size:
            raise TsConfigError(
                f"--update-freq {update_freq} gives each update fewer micro-batches than the {pipeline_size} pipeline "
                f"stages (most stages would idle): use --update-freq {pipeline_size} or more"
            )
        if chunks > 1 and update_freq % pipeline_size != 0:
            raise TsConfigError(
                f"--virtual-pipeline-stages {chunks} runs micro-batches in groups of the pipeline size "
                f"{pipeline_size}: use an --update-freq that is a multiple of it (not {update_freq})"
            )
