"""The trainer ``fairseq-train`` uses with this plugin, at every tensor-parallel size
(installed by :func:`torchscale_fairseq.integration.install.install`). As fairseq's own
``MegatronTrainer``, it changes training by overriding ``Trainer``:

- data parallelism runs over our data-parallel group under tensor parallelism
  (Megatron-LM appendix B.1): gradients are averaged and batches sharded over it, and
  the ranks of one tensor-parallel group see identical batches; under ``--context-parallel-size``
  the ranks of a context-parallel group read the same batch too, each keeps the targets of its
  chunks (:mod:`.context_parallel_batches`), and gradients, sample sizes and statistics reduce
  over the data-parallel x context-parallel group (the sentences counted once per group);
- under ``--sequence-parallel`` the gradients of the parameters used on a slice of the
  sequence are summed over the tensor-parallel group before the norm;
- the gradient norm counts every gradient once (the optimizer's ``clip_grad_norm`` is
  :mod:`.clip_grad_norm`'s, over the trainer's parallel context); fp32 master copies carry their parameters' attributes;
  SparseClip's dense and expert parts are logged on unscaled gradients;
- ``--bf16`` trains on CUDA (or the CPU), not on a TPU (:mod:`.bf16_device`); ``--amp`` on
  the CPU autocasts to bfloat16 (:mod:`.cpu_autocast`; fairseq's autocast is CUDA-only);
- Python's garbage collector does not run inside a training step, and the step's logging adds no
  host sync (:mod:`.host_overhead`, :meth:`TsTrainer._reduce_and_log_stats`);
- under ``--ts-compile``, after the first update, one line says whether torch.compile ran everything
  it compiled whole or, as a warning, what it left eager or broke
  (:mod:`~torchscale_fairseq.architecture.compile_report`);
- a non-finite gradient norm skips the update in every precision mode and on every
  device (stock fairseq raises ``FloatingPointError`` in fp32, and its overflow handler
  calls ``torch.tensor(0.0).cuda()``, which fails without CUDA); after
  ``--max-skipped-updates`` skips in a row training stops with one line; under
  ``--ts-sync-free-step`` the fused optimizer kernel skips it on the device, the update is
  counted, and skips are read every ``--log-interval`` updates, before validation and at each
  checkpoint save (:class:`.host_overhead.DeviceSkips`);
- an MoE model with a criterion that ignores the balance loss is refused before any step
  (:mod:`torchscale_fairseq.criterions.balance_check`);
- expert parameters (:mod:`torchscale_fairseq.modules.moe.grad_sync`): DDP leaves them
  out and their gradients are averaged over their replica groups;
- after each update the MoE layers' auxiliary-loss-free expert biases move by the update's
  load (``--moe-router-bias-update-rate``, :func:`~torchscale_fairseq.modules.moe.layer.update_expert_biases`);
  a skipped update moves none;
- ``--zero-sharding os`` shards the optimizer state over the data-parallel group
  (:mod:`torchscale_fairseq.optim.zero`, ZeRO stage 1, no fairscale); experts stay local;
  ``--zero-sharding full`` shards parameters, gradients and optimizer state with FSDP2's
  ``fully_shard`` in place of DDP (:mod:`torchscale_fairseq.optim.fully_sharded`, ZeRO stage 3),
  and its checkpoints hold the full state, gathered when saving;
- the MoE layers' auxiliary losses are differentiated with their outputs, scaled per micro-batch
  before its forward, and ``--pipeline-model-parallel-size`` runs each update's micro-batches
  through the stages in the schedule's order (:class:`~.pipeline_step.ScheduledTrainer`, the base
  class); each stage draws its own dropout masks (its seed offset by the pipeline rank, as
  Megatron-LM's);
- checkpoints: with experts spread over data-parallel ranks every rank saves and loads
  its own ``-shard<r>`` file; under tensor parallelism each rank loads its own
  ``-model_part-<k>`` part, under pipeline parallelism its own ``-stage<p>`` file (layers named
  by their global index); every checkpoint records the tensor-parallel layout, the pipeline
  stage, the parameters in optimizer order and the RNG tracker; ranks whose files are of different
  updates (a save cut short), and optimizer state recorded in another parameter order than the
  model's, are refused in one line (:mod:`torchscale_fairseq.checkpoints.rank_files`); a failed
  write is one line and leaves the previous checkpoints intact.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from fairseq import optim, utils
from fairseq.logging import metrics
from omegaconf import open_dict

from torchscale_fairseq.architecture.compile_report import compile_fallback_report, compiled_graphs
from torchscale_fairseq.architecture.padding_layout import mark_padding_layout, padding_layout
from torchscale_fairseq.architecture.pipeline_stage import pipeline_names
from torchscale_fairseq.checkpoints.layout import RECORD_KEY, checkpoint_suffix, split_suffix
from torchscale_fairseq.checkpoints.rank_files import (
    check_ranks_resume_together,
    check_saved_layout,
    rank_record,
    restore_from_record,
)
from torchscale_fairseq.compat.checkpoint_writes import checkpoint_write_error, remove_if_present
from torchscale_fairseq.criterions.balance_check import check_balance_loss_criterion
from torchscale_fairseq.criterions.fused_loss_check import check_fused_loss_run
from torchscale_fairseq.data.stream_iterator import StreamEpochBatchIterator
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.bf16_device import bf16_without_tpu
from torchscale_fairseq.integration.clip_grad_norm import use_parallel_context
from torchscale_fairseq.integration.context_parallel_batches import context_parallel_sample
from torchscale_fairseq.integration.cpu_autocast import cpu_autocast
from torchscale_fairseq.integration.host_overhead import (
    DeviceSkips,
    LazyLoggingOutput,
    check_cuda_graphs,
    check_sync_free_step,
    fused_adam,
    no_gc_pause,
)
from torchscale_fairseq.integration.pipeline_step import ScheduledTrainer, check_pipeline_run
from torchscale_fairseq.integration.tensor_parallel_init import multi_process_error
from torchscale_fairseq.model_parallel.attributes import copy_parallel_attributes, is_expert
from torchscale_fairseq.model_parallel.context_parallel import sequence_multiple
from torchscale_fairseq.model_parallel.grads import sum_sequence_parallel_grads
from torchscale_fairseq.model_parallel.parallel_context import current_parallel_context
from torchscale_fairseq.models.config import MAX_SKIPPED_UPDATES
from torchscale_fairseq.modules.moe.grad_sync import keep_experts_out_of_ddp, sync_experts_after
from torchscale_fairseq.modules.moe.layer import discard_expert_loads, update_expert_biases
from torchscale_fairseq.optim.flat_master import ForeachFP16Optimizer
from torchscale_fairseq.optim.fully_sharded import (
    FULL,
    check_fully_sharded,
    data_parallel_mesh,
    full_model_state,
    full_optimizer_state,
    mixed_precision,
    shard_loaded_optimizer_state,
    shard_model,
)
from torchscale_fairseq.optim.grad_norm import FLAT_MASTER_SOURCES
from torchscale_fairseq.optim.master_adamw import check_fused_master_step
from torchscale_fairseq.optim.sparse_clip import SparseClip, check_foreign_flags
from torchscale_fairseq.optim.zero import check_zero_sharding, shard_optimizer_state

logger = logging.getLogger(__name__)

PIPELINE_SEED_STRIDE = 100  # seed + stride x pipeline rank (Megatron-LM's model_parallel_cuda_manual_seed)
# What fairseq's train_step reads of a sync-free step's norm (its isfinite test, a host read): a host value, so
# it waits for nothing; the device's norm is logged and decides the update on the device (DeviceSkips)
HOST_NORM = torch.zeros(())


@contextlib.contextmanager
def _config_value(cfg: Any, group: str, name: str, value: Any) -> Iterator[None]:
    """``cfg.group.name`` is ``value`` for the duration."""
    section = getattr(cfg, group)
    original = getattr(section, name)
    with open_dict(cfg):
        setattr(section, name, value)
    try:
        yield
    finally:
        with open_dict(cfg):
            setattr(section, name, original)


@contextlib.contextmanager
def _building(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` for the duration (fairseq's trainer looks its wrapper classes up there)."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


class SkippedUpdate(Exception):
    """The update is skipped (non-finite gradient norm or fp16 overflow)."""


def _too_many_skips(in_a_row: int, updates: int) -> TsConfigError:
    return TsConfigError(
        f"{in_a_row} updates in a row skipped for a non-finite gradient norm (after update {updates}): lower --lr, "
        "add warm-up or --clip-norm, check the data, or raise --max-skipped-updates"
    )


def _shared_pad(task: Any) -> int | None:
    """The pad index of the task's source and target dictionaries, ``None`` where they differ or
    one is missing (a decoder-only model reads ``src_tokens`` with the target's pad)."""
    pads = set()
    for dictionary in ("source_dictionary", "target_dictionary"):
        try:
            vocab = getattr(task, dictionary)
        except (AttributeError, NotImplementedError):  # FairseqTask's own properties raise the latter
            vocab = None
        pads.add(vocab.pad() if vocab is not None else None)
    return pads.pop() if len(pads) == 1 else None


def carry_parallel_attributes(optimizer: Any) -> None:
    """Give fp16's fp32 master copies the attributes of their parameters: one master
    per parameter gets its attributes, a flat master remembers its source parameters."""
    masters = getattr(optimizer, "fp32_params", None)
    sources = getattr(optimizer, "fp16_params", None)
    if masters is None or sources is None:
        return
    if isinstance(masters, dict):
        for master in masters.values():
            setattr(master, FLAT_MASTER_SOURCES, list(sources))
    else:
        for param, master in zip(sources, masters):
            copy_parallel_attributes(master, param)


def _inner_optimizer(optimizer: Any) -> Any:
    """The fairseq optimizer inside fairseq's precision wrappers (the one whose ``clip_grad_norm`` they call)."""
    return getattr(optimizer, "fp32_optimizer", None) or getattr(optimizer, "wrapped_optimizer", None) or optimizer


def _sparse_clip(optimizer: Any) -> SparseClip | None:
    """The SparseClip optimizer inside fairseq's precision wrappers, if any."""
    inner = _inner_optimizer(optimizer)
    return inner if isinstance(inner, SparseClip) else None


def _pending_factor(optimizer: Any) -> float | torch.Tensor:
    """What fairseq's fp16/bf16 wrappers still multiply the gradients by (1 / loss scale); a
    copy, since clipping later multiplies the wrapper's tensor in place."""
    factor = getattr(optimizer, "_multiply_factor", 1.0)
    return factor.clone() if torch.is_tensor(factor) else factor


class TsTrainer(ScheduledTrainer):
    """fairseq's ``Trainer`` with the changes listed in the module docstring."""

    def __init__(self, cfg, task, model, criterion, quantizer=None, **kwargs) -> None:
        self.parallel = current_parallel_context()  # the groups distributed_init built (read once, kept)
        if cfg.common.model_parallel_size > 1 and self.parallel.tensor_size != cfg.common.model_parallel_size:
            raise multi_process_error(cfg.common.model_parallel_size)
        context_size = getattr(cfg.model, "context_parallel_size", 1) or 1
        if context_size != self.parallel.context_size:
            raise TsConfigError(
                f"--context-parallel-size {context_size} needs a multi-process run of a multiple of {context_size} "
                f"ranks (this one has {self.parallel.world_size}): launch them with torchrun or --distributed-world-size"
            )
        if context_size > 1 and getattr(cfg.criterion, "sentence_avg", False):
            raise TsConfigError(
                f"--context-parallel-size {context_size} splits each sentence over {context_size} ranks, so "
                "--sentence-avg would count every sentence on each: drop --sentence-avg (token averages) or use "
                "--context-parallel-size 1"
            )
        check_foreign_flags(cfg.optimizer)
        self.sync_free = bool(getattr(cfg.model, "ts_sync_free_step", False))
        if self.sync_free:
            check_sync_free_step(cfg)
        self.fused_master_step = bool(getattr(cfg.model, "ts_fused_master_step", False))
        if self.fused_master_step:
            check_fused_master_step(cfg, torch.cuda.is_available() and not cfg.common.cpu)
        if getattr(cfg.model, "ts_cuda_graphs", False):
            cuda = torch.cuda.is_available() and not cfg.common.cpu
            check_cuda_graphs(cfg, self.parallel.world_size, torch.cuda.get_device_capability() if cuda else None)
        check_zero_sharding(cfg, self.data_parallel_world_size)
        self.fully_sharded = cfg.distributed_training.zero_sharding == FULL
        check_fully_sharded(cfg, self.parallel.data_context_size, self.parallel.pipeline_size,
                            any(is_expert(p) for p in model.parameters()))
        bf16_without_tpu(cfg)
        check_balance_loss_criterion(model, criterion, str(cfg.criterion._name), cfg.model)
        check_fused_loss_run(model, criterion, cfg)
        if self.parallel.pipeline_size > 1:
            check_pipeline_run(cfg, self.parallel.data_context_size, self.parallel.pipeline_size)
        # --zero-sharding full --bf16: fp32 shards, bf16 compute (MixedPrecisionPolicy), so fairseq
        # neither casts the model nor builds its fp32 master
        with _config_value(cfg, "common", "bf16", cfg.common.bf16 and not self.fully_sharded):
            super().__init__(cfg, task, model, criterion, quantizer, **kwargs)
        self._gathered_model_state = None  # --zero-sharding full: consolidate_optimizer's gathered model
        self.skipped_in_a_row = 0
        self.device_skips: DeviceSkips | None = None  # --ts-sync-free-step: built with the optimizer
        self._step_norm: torch.Tensor | None = None  # the device's norm of a sync-free step
        self._applied: torch.Tensor | None = None  # whether its update applied (device 0/1)
        self._layout_pad = _shared_pad(task)  # padding layouts are found where it is known (_prepare_sample)
        self._train_iterator = None  # the last get_train_iterator's (consolidate_optimizer syncs its positions)
        self._ts_compile = bool(getattr(cfg.model, "ts_compile", False))
        self._compile_report_pending = self._ts_compile
        self._fallbacks_reported: str | None = None  # the last compile_fallback_report logged
        self._graphs_unreported = 0  # graphs compiled in skipped updates since the last report

    # data parallelism -------------------------------------------------------------

    @property
    def data_parallel_world_size(self) -> int:
        return self.parallel.data_context_size

    @property
    def data_parallel_process_group(self):
        return self.parallel.data_context_group

    @property
    def data_parallel_rank(self) -> int:
        return self.parallel.data_context_rank

    @contextlib.contextmanager
    def _batch_shards(self) -> Iterator[None]:
        """While fairseq builds an epoch iterator, its batches shard over the data-parallel ranks
        only: the ranks of a context-parallel group read the same batches."""
        parallel, original = self.parallel, self.task.get_batch_iterator
        if parallel.context_size == 1:
            yield
            return

        def sharded(*args, **kwargs):
            if kwargs.get("num_shards", 1) == parallel.data_context_size:
                kwargs.update(num_shards=parallel.data_size, shard_id=parallel.data_rank)
            return original(*args, **kwargs)

        with _building(self.task, "get_batch_iterator", sharded):
            yield

    def _prepare_sample(self, sample, is_dummy=False):
        """Under context parallelism, this rank's targets of the sample (:mod:`.context_parallel_batches`;
        the dummy batch too, split once). The input tokens' padding layouts are found on the host, before
        fairseq moves the batch to the device, and marked on the moved tensors, so that the model's forward
        reads nothing back to choose its masks (:mod:`~torchscale_fairseq.architecture.padding_layout`)."""
        if self.parallel.context_size > 1 and isinstance(sample, dict) and len(sample) > 0:
            multiple = sequence_multiple(self.parallel.context_size, self.parallel.tensor_size,
                                         bool(getattr(self.cfg.model, "sequence_parallel", False)))
            sample = context_parallel_sample(sample, self.parallel.context_size, self.parallel.context_rank, multiple,
                                             self.task.target_dictionary.pad())
        layouts = self._padding_layouts(sample) if self._layout_pad is not None else {}
        sample, dummy = super()._prepare_sample(sample, is_dummy)
        for key, layout in layouts.items():
            mark_padding_layout(sample["net_input"][key], layout)
        return sample, dummy

    def _padding_layouts(self, sample: Any) -> dict[str, str]:
        """``{net_input key: padding layout}`` of the token tensors still on the host."""
        net_input = sample.get("net_input") if isinstance(sample, dict) else None
        if not isinstance(net_input, dict):
            return {}
        return {key: padding_layout(tokens, self._layout_pad) for key in ("src_tokens", "prev_output_tokens")
                if torch.is_tensor(tokens := net_input.get(key)) and tokens.dim() == 2 and tokens.device.type == "cpu"}

    def _aggregate_logging_outputs(self, logging_outputs, *extra_stats_to_sum, ignore=False):
        """fairseq's sum over the data-context group; under context parallelism the criterion's
        ``nsentences`` (``target.size(0)``, the same on the ``C`` ranks of a group) counts on context
        rank 0 only, so that ``bsz`` is that of ``C = 1``."""
        if self.parallel.context_rank > 0:
            logging_outputs = [{**log, "nsentences": 0} if "nsentences" in log else log for log in logging_outputs]
        return super()._aggregate_logging_outputs(logging_outputs, *extra_stats_to_sum, ignore=ignore)

    @property
    def model(self):
        if self._wrapped_model is None and self.fully_sharded:  # FSDP2 in place of DDP
            mesh = data_parallel_mesh(self.data_parallel_process_group, self.device)
            self._model = self._model.to(self.device)
            self._wrapped_model = shard_model(self._model, mesh, mixed_precision(self.cfg.common.bf16))
            return self._wrapped_model
        if self._wrapped_model is None and self.use_distributed_wrapper and keep_experts_out_of_ddp(
                self._model, self.cfg.distributed_training.ddp_backend):
            wrapped = super().model
            sync_experts_after(wrapped, self._model, self.parallel)
            return wrapped
        return super().model

    # optimizer, gradient norm, skipped updates ------------------------------------------

    def _build_optimizer(self) -> None:
        """fairseq's optimizer (``--fp16``/``--bf16``: :class:`~torchscale_fairseq.optim.flat_master.ForeachFP16Optimizer`,
        whose flat fp32 master is copied with multi-tensor copies); with ``--zero-sharding os`` its state is sharded over the
        data-parallel group by :mod:`torchscale_fairseq.optim.zero` (fairseq's own branch,
        fairscale's ``OSS``, is kept out by hiding the flag from ``super()``), after the fp32
        masters got their parameters' attributes: experts stay local, unsharded. The optimizer's
        gradient norm runs over the trainer's parallel context."""
        sharding = self.cfg.distributed_training.zero_sharding
        with _config_value(self.cfg, "distributed_training", "zero_sharding", "none"), \
                _config_value(self.cfg, "common", "bf16", self.cfg.common.bf16 and not self.fully_sharded), \
                _building(optim, "FP16Optimizer", ForeachFP16Optimizer):
            super()._build_optimizer()
        carry_parallel_attributes(self._optimizer)
        use_parallel_context(_inner_optimizer(self._optimizer), self.parallel)
        if sharding == "os":
            shard_optimizer_state(self._optimizer, self.data_parallel_process_group, is_expert,
                                  consolidate_to_all=self.is_expert_sharded)
        if self.fully_sharded:  # checkpoints hold full moments: each rank keeps its shard
            self._optimizer.optimizer.register_load_state_dict_post_hook(shard_loaded_optimizer_state)
        if self.sync_free:
            self.device_skips = DeviceSkips(fused_adam(_inner_optimizer(self._optimizer)))
        if self.fused_master_step:
            self._optimizer.use_master_adamw(self.parallel)

    def clip_grad_norm(self, clip_norm: float) -> torch.Tensor:
        # fairseq calls this once per update, after the data-parallel all-reduce
        sum_sequence_parallel_grads(self._model, self.parallel.tensor_group)
        factor = _pending_factor(self.optimizer)
        try:
            norm = super().clip_grad_norm(clip_norm)
        except OverflowError as e:  # fp16's loss scaler saw an overflow (and adapted)
            self._log_norm_parts(factor)
            raise SkippedUpdate(str(e)) from e
        self._log_norm_parts(factor)
        if self.device_skips is not None:
            self._step_norm, self._applied = norm, self.device_skips.mark(norm)
            return HOST_NORM
        if not self.cfg.common.amp and not bool(torch.isfinite(norm).all()):
            raise SkippedUpdate(f"non-finite gradient norm {float(norm)}: update skipped")
        return norm

    def _check_grad_norms(self, grad_norm):
        """fairseq's check that the data-parallel ranks' norms agree (CUDA, more than one rank: a
        host read), of the device's norm on a sync-free step, a non-finite one as 0 (every rank
        skips that update alike)."""
        if self.device_skips is not None:
            grad_norm = torch.nan_to_num(self._step_norm, nan=0.0, posinf=0.0, neginf=0.0)
        super()._check_grad_norms(grad_norm)

    def _reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
        """fairseq's, without its host syncs in a training step, so the host can queue the next
        step while the device finishes this one: a norm that reaches here is finite (a non-finite
        one skipped the update in :meth:`clip_grad_norm`), so fairseq's second ``isfinite`` test is
        not repeated; and the per-step return value, which fairseq-train does not read (it logs
        the meters every ``--log-interval``), is reduced only when read (:class:`LazyLoggingOutput`)."""
        if grad_norm is not None and self.device_skips is not None:
            grad_norm = self._step_norm  # not finite where the update was skipped on the device
        if grad_norm is None or self.tpu or self.cfg.common.amp:  # --amp may reach here with a non-finite norm
            return super()._reduce_and_log_stats(logging_outputs, sample_size, grad_norm)
        metrics.log_speed("ups", 1.0, priority=100, round=2)
        metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
        clip_norm = self.cfg.optimization.clip_norm
        if clip_norm > 0:
            clipped = torch.where(grad_norm > clip_norm, grad_norm.new_tensor(100), grad_norm.new_tensor(0))
            metrics.log_scalar("clip", clipped, priority=500, round=1)
        with metrics.aggregate() as agg:
            self.task.reduce_metrics(logging_outputs, self.get_criterion())
            if "loss" not in agg:  # fairseq's warning and placeholder for a criterion that logs no loss
                if "loss" not in self._warn_once:
                    self._warn_once.add("loss")
                    logger.warning("Criterion.reduce_metrics did not log a 'loss' value, which may break some "
                                   "functionality")
                metrics.log_scalar("loss", -1)
        return LazyLoggingOutput(agg, sample_size)

    def _log_norm_parts(self, factor: float | torch.Tensor) -> None:
        sparse = _sparse_clip(self.optimizer)
        if sparse is None or sparse.last_norm is None:
            return
        # logged as tensors (as fairseq logs gnorm): no host sync per step
        metrics.log_scalar("gnorm_dense", sparse.last_norm.dense * factor, priority=710, round=3)
        metrics.log_scalar("gnorm_expert", sparse.last_norm.expert * factor, priority=720, round=3)

    # pipeline parallelism -------------------------------------------------------------

    def _set_seed(self) -> None:
        seed = self.cfg.common.seed + self.get_num_updates() + PIPELINE_SEED_STRIDE * self.parallel.pipeline_rank
        utils.set_torch_seed(seed)

    @metrics.aggregate("train")
    def train_step(self, samples, raise_oom: bool = False):
        updates = self.get_num_updates()
        graphs_before = compiled_graphs() if self._ts_compile else 0
        try:
            with no_gc_pause(), cpu_autocast(self.cfg.common.amp, self.device):
                logging_output = super().train_step(samples, raise_oom)
        except SkippedUpdate as e:
            if self._ts_compile:
                self._graphs_unreported += compiled_graphs() - graphs_before
            discard_expert_loads(self._model)
            return self._skip_update(str(e))
        self.skipped_in_a_row = 0
        if self._ts_compile:
            self._report_compilations(compiled_graphs() - graphs_before)
        if self.get_num_updates() > updates:  # --moe-router-bias-update-rate: after the optimizer step
            update_expert_biases(self._model, self.data_parallel_process_group if self.data_parallel_world_size > 1
                                 else None, self._applied if self.device_skips is not None else None)
        else:
            discard_expert_loads(self._model)
        if self.device_skips is not None and self.get_num_updates() % max(1, self.cfg.common.log_interval) == 0:
            self._report_device_skips()
        return logging_output

    def begin_valid_epoch(self, epoch):
        if self.device_skips is not None:  # the skips since the last report come before validation's lines
            self._report_device_skips()
        super().begin_valid_epoch(epoch)

    def _report_compilations(self, graphs: int) -> None:
        """``--ts-compile``, after an update that made ``graphs`` compiled graphs: after the first, whether every
        compiled function ran whole; after a later one that compiled (a recompile or a new code path: the update
        waited for it), how many graphs, those of skipped updates since the last report included; and the warning
        of :func:`compile_fallback_report` again whenever its counts grew (validation's are seen at the next update),
        from the first rank of each pipeline stage (the others log it at INFO, which fairseq keeps off their console;
        a fallback that one replica alone meets, on a batch shape or path of its own, is logged there at INFO)."""
        graphs, self._graphs_unreported = graphs + self._graphs_unreported, 0
        report = compile_fallback_report()
        if self._compile_report_pending:  # once, after this process's first update compiled the layers
            self._compile_report_pending = False
            if report is None:
                logger.info("--ts-compile: the first update ran every compiled function whole (no graph break, "
                            "no function left eager)")
        elif graphs > 0:
            logger.info(f"--ts-compile: update {self.get_num_updates()} compiled {graphs} new graph(s) (a recompile for "
                        "a new input shape or mode, or a new code path; TORCH_LOGS=recompiles shows why)")
        if report is not None and report != self._fallbacks_reported:
            self._fallbacks_reported = report
            parallel = self.parallel  # the replicas of a pipeline stage compile alike: one warning per stage
            stage = f" (pipeline stage {parallel.pipeline_rank})" if parallel.pipeline_size > 1 else ""
            first_of_stage = parallel.data_context_rank == 0 and parallel.tensor_rank == 0
            logger.log(logging.WARNING if first_of_stage else logging.INFO, f"--ts-compile{stage}: {report}")

    def _report_device_skips(self) -> None:
        """The sync-free step's skips since the last report (one host read): a log line, and
        ``--max-skipped-updates`` in a row stop training. Read every ``--log-interval`` updates,
        before validation and at each checkpoint save, on every rank (a run's last skips are
        reported unless it stops between reports with ``--no-save`` and no validation)."""
        skipped, longest = self.device_skips.report()
        if skipped:
            logger.info(f"NOTE: {skipped} update(s) before update {self.get_num_updates()} had a non-finite gradient "
                        "norm and were skipped on the device (counted as updates)")
        limit = getattr(self.cfg.model, "max_skipped_updates", MAX_SKIPPED_UPDATES)
        if 0 < limit <= longest:
            raise _too_many_skips(longest, self.get_num_updates())

    def _skip_update(self, reason: str) -> None:
        """fairseq's overflow path: no update counted, no parameter changed."""
        logger.info(f"NOTE: gradient overflow detected, ignoring gradient, {reason}")
        if hasattr(self, "param_names") and hasattr(self.optimizer, "fp32_optimizer"):
            for p, name in zip(self.optimizer.fp32_optimizer.params, self.param_names):
                if p.grad is not None and not bool(torch.isfinite(p.grad).all()):  # --ts-fused-master-step: none
                    logger.info(f"overflow in param {name}")
        self.zero_grad()
        if self.cfg.common.fp16 or self.cfg.common.amp:
            scaler = self.optimizer.scaler
            scale = scaler.loss_scale if self.cfg.common.fp16 else scaler.get_scale()
            metrics.log_scalar("loss_scale", scale, priority=700, round=4, weight=0)
        metrics.log_stop_time("train_wall")
        if not self.cfg.common.fp16:  # fp16's scaler stops itself at --min-loss-scale
            self.skipped_in_a_row += 1
            limit = getattr(self.cfg.model, "max_skipped_updates", MAX_SKIPPED_UPDATES)
            if 0 < limit <= self.skipped_in_a_row:
                raise _too_many_skips(self.skipped_in_a_row, self.get_num_updates())
        return None

    # checkpoints --------------------------------------------------------------------

    @property
    def is_expert_sharded(self) -> bool:
        """Experts are spread over data-parallel ranks: each rank saves its own shard."""
        return self.data_parallel_world_size > 1 and any(is_expert(p) for p in self._model.parameters())

    @property
    def should_save_checkpoint_on_current_rank(self) -> bool:
        return True if self.is_expert_sharded else super().should_save_checkpoint_on_current_rank

    @property
    def expert_parallel_size_and_rank(self) -> tuple[int, int]:
        """``(number of expert shards, this rank's shard)``: ``(1, 0)`` unless sharded."""
        return (self.data_parallel_world_size, self.data_parallel_rank) if self.is_expert_sharded else (1, 0)

    @property
    def checkpoint_suffix(self) -> str:
        base = split_suffix(super().checkpoint_suffix)[0]  # without the part distributed_init appended
        ep_size, ep_rank = self.expert_parallel_size_and_rank
        parallel = self.parallel
        return checkpoint_suffix(parallel.tensor_rank, parallel.tensor_size, ep_rank, ep_size, base,
                                 parallel.pipeline_rank, parallel.pipeline_size)

    @property
    def _saves_per_rank(self) -> bool:
        """Every rank reads (and its data-parallel rank 0 writes) its own file."""
        return self.is_expert_sharded or self.parallel.tensor_size > 1 or self.parallel.pipeline_size > 1

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self._gathered_model_state is not None:  # --zero-sharding full (else: a crash.pt of this rank's shards)
            state["model"], self._gathered_model_state = self._gathered_model_state, None
        model = self.get_model()
        stack = getattr(model, "pipeline_stack", None)
        names = pipeline_names(model, stack) if stack is not None else None
        state["extra_state"][RECORD_KEY] = rank_record(model, self.parallel, *self.expert_parallel_size_and_rank, names)
        return state

    def save_checkpoint(self, filename: str, extra_state: dict):
        if self.is_expert_sharded:
            os.makedirs(os.path.dirname(os.path.abspath(filename)), exist_ok=True)
        try:
            return super().save_checkpoint(filename, extra_state)
        except OSError as e:
            if "://" not in str(filename):
                remove_if_present(f"{filename}.tmp")
            raise checkpoint_write_error(filename, e) from e

    def get_train_iterator(self, *args, **kwargs):
        with self._batch_shards():
            self._train_iterator = super().get_train_iterator(*args, **kwargs)
        return self._train_iterator

    def get_valid_iterator(self, *args, **kwargs):
        with self._batch_shards():
            return super().get_valid_iterator(*args, **kwargs)

    def consolidate_optimizer(self) -> None:
        """fairseq's, and the streaming tasks' stream positions of every data-parallel rank
        gathered into the epoch iterator, whose state data-parallel rank 0 alone then saves
        (exact mid-epoch resume on every rank); ``--ts-sync-free-step``'s skips reported on every
        rank alike. fairseq's ``save_checkpoint`` calls this on every rank before it takes the
        iterator's state; a step's exception handler calls it too, on its rank alone, for a
        ``crash.pt`` without the iterator: no collective there, and no report to raise."""
        if self.device_skips is not None and sys.exc_info()[1] is None:
            self._report_device_skips()
        super().consolidate_optimizer()
        if self.fully_sharded and sys.exc_info()[1] is None:
            self._gather_full_state()
        if isinstance(self._train_iterator, StreamEpochBatchIterator) and sys.exc_info()[1] is None:
            self._train_iterator.sync_positions()

    def _gather_full_state(self) -> None:
        """``--zero-sharding full``: the full model and optimizer state, gathered on every rank of
        the data-parallel group (a collective), kept by the rank that saves for :meth:`state_dict`."""
        model = full_model_state(self.model)
        optimizer = None
        if not self.cfg.checkpoint.no_save_optimizer_state:
            optimizer = full_optimizer_state(self.optimizer.state_dict())
        if self.should_save_checkpoint_on_current_rank:
            self._gathered_model_state, self._gathered_optim_state = model, optimizer

    def load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False, optimizer_overrides=None,
                        reset_meters=False):
        check_saved_layout(filename)
        if self._saves_per_rank:  # every rank reads its own shard / part / stage (no broadcast)
            with open_dict(self.cfg):
                self.cfg.checkpoint.load_checkpoint_on_all_dp_ranks = True
        extra_state = super().load_checkpoint(filename, reset_optimizer, reset_lr_scheduler, optimizer_overrides,
                                              reset_meters)
        if self._saves_per_rank:
            check_ranks_resume_together(filename, self.get_num_updates(), split_suffix(self.checkpoint_suffix)[0])
        restore_from_record(extra_state, self.get_model(), self.parallel.tensor_size, filename, reset_optimizer)
        return extra_state
