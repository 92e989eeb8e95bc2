"""What keeps the host from idling the device during a training step: no garbage-collector pause
inside the step, a per-step logging output reduced only when read, (``--ts-sync-free-step``)
non-finite updates skipped on the device rather than tested on the host, and (``--ts-cuda-graphs``,
:mod:`~torchscale_fairseq.architecture.cuda_graphs`) the layers' kernels replayed from CUDA graphs."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torchscale_fairseq.errors import TsConfigError


@contextlib.contextmanager
def no_gc_pause() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (as nanochat's training loop): a
    collection triggered by the allocations of a step would pause it, idling the device; it runs
    at the first allocation after the step instead, while the device works through the step."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class LazyLoggingOutput(Mapping):
    """fairseq's per-step logging output (``agg.get_smoothed_values()`` plus ``sample_size``, less
    ``ppl``, ``wps``, ``wpb`` and ``bsz``), computed on first read: each value is a host sync."""

    def __init__(self, agg: Any, sample_size: Any) -> None:
        self._agg, self._sample_size, self._values = agg, sample_size, None

    def _read(self) -> dict:
        if self._values is None:
            values = dict(self._agg.get_smoothed_values())
            for key in ("ppl", "wps", "wpb", "bsz"):
                values.pop(key, None)
            values["sample_size"] = self._sample_size
            self._values = values
        return self._values

    def __getitem__(self, key: str) -> Any:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


def check_sync_free_step(cfg: Any) -> None:
    """``--ts-sync-free-step``'s one-line refusals before anything is built."""
    common = cfg.common
    if common.fp16 or common.memory_efficient_fp16 or common.amp:
        raise TsConfigError("--ts-sync-free-step: fp16's loss scaler reads every update's overflow on the host: train "
                            "in fp32 or --bf16, or drop --ts-sync-free-step")
    sharding = cfg.distributed_training.zero_sharding
    if sharding != "none":
        raise TsConfigError(f"--ts-sync-free-step with --zero-sharding {sharding} is not supported yet: drop one of "
                            "them")


def check_cuda_graphs(cfg: Any, world_size: int, capability: tuple[int, int] | None) -> None:
    """``--ts-cuda-graphs``' one-line refusals of a training run (the model refuses what its layers
    cannot capture: :func:`~torchscale_fairseq.architecture.cuda_graphs.check_graphable`);
    ``capability``: the CUDA device's compute capability (``None``: the run is on the CPU). MoE
    layers are captured with grouped expert GEMMs, which need bf16 on compute capability 9.0."""
    moe = (getattr(cfg.model, "moe_expert_count", 0) or 0) > 0
    bf16 = cfg.common.bf16 or getattr(cfg.common, "memory_efficient_bf16", False)
    clashes = [
        (capability is None, "needs a CUDA device and this run is on the CPU: drop the flag"),
        (cfg.common.amp, "cannot replay --amp's autocast (it caches casts across calls): use --bf16 or --fp16"),
        (world_size > 1, f"runs on one GPU for now (this run has {world_size} ranks): drop the flag"),
        (getattr(cfg.task, "document_masking", False),
         "captures layers without a document mask: drop --document-masking or the flag"),
        (getattr(cfg.model, "fp8", "none") != "none", "and --fp8 have not been tested together: drop one of the two"),
        (moe and not bf16, "captures MoE layers whose experts run grouped GEMMs, in bf16: add --bf16 or drop the flag"),
        (moe and capability is not None and tuple(capability) < (9, 0),
         f"captures MoE layers whose experts run grouped GEMMs, which need a GPU of compute capability 9.0 or more "
         f"(this one: {'.'.join(map(str, capability or ()))}): drop the flag"),
    ]
    why = next((why for clash, why in clashes if clash), None)
    if why is not None:
        raise TsConfigError(f"--ts-cuda-graphs {why}")


def fused_adam(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside fairseq optimizer ``optimizer``, which must be torch's fused
    Adam or AdamW: its kernel skips an update where ``found_inf`` is 1 (parameters, moments and
    step count unchanged), as ``torch.amp.GradScaler`` drives it."""
    inner = getattr(optimizer, "optimizer", None)
    if not (isinstance(inner, torch.optim.Adam) and inner.defaults.get("fused")):
        raise TsConfigError(
            "--ts-sync-free-step skips a non-finite update inside torch's fused Adam kernel, and this run's optimizer "
            f"step is {type(inner).__name__}: use --optimizer ts_adamw (fused, the default where torch has the kernel; "
            "without --zero-sharding) or drop --ts-sync-free-step"
        )
    return inner


class DeviceSkips:
    """Updates skipped on the device (``--ts-sync-free-step``): each update's gradient norm sets the
    fused optimizer's ``found_inf`` (1 where the norm is not finite) with no host read, and the
    counts (skips in a row, the longest run and the number of skips since the last report) stay on
    the device until :meth:`report` reads them, one host sync per report."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.counts: torch.Tensor | None = None  # (skips in a row now, longest run, skips) since the last report

    def mark(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """Have the optimizer skip this update where ``grad_norm`` is not finite; returns
        whether the update applies (1) or not (0), on the device."""
        skip = (~torch.isfinite(grad_norm)).float()
        self.optimizer.found_inf = skip
        counts = self.counts if self.counts is not None else torch.zeros(3, device=skip.device)
        run = (counts[0] + 1) * skip
        self.counts = torch.stack([run, torch.maximum(counts[1], run), counts[2] + skip])
        return 1.0 - skip

    def report(self) -> tuple[int, int]:
        """(skips since the last report, the longest run of skips in a row among them): a host read."""
        if self.counts is None:
            return 0, 0
        run, longest, skipped = (int(v) for v in self.counts.tolist())
        self.counts = self.counts.new_tensor([run, run, 0])
        return skipped, longest
