"""``--optimizer ts_adamw``: fairseq's Adam update (``--optimizer adam``: decoupled weight
decay, bias correction) run by PyTorch's ``torch.optim.AdamW``, by default as its fused
multi-tensor kernel (one kernel for all parameters per device and dtype; CUDA, and the CPU).
Per parameter ``p`` with gradient ``g``, step ``t`` (from 1) and moments ``m``, ``v`` (from 0):

    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr * weight_decay * p
    p <- p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

Flags and defaults are ``adam``'s: ``--adam-betas`` (0.9, 0.999), ``--adam-eps`` (1e-8),
``--weight-decay`` (0), ``--lr``. One difference: fairseq's Adam adds ``eps`` before the
bias correction of ``v`` (Kingma & Ba's "epsilon hat", section 2), its denominator is
``(sqrt(v) + eps) / sqrt(1 - beta2^t)``, so its epsilon is ``eps / sqrt(1 - beta2^t)`` in the
formula above: larger in the first steps (32x at t = 1 with beta2 = 0.999, 7x with 0.98;
within 10% once ``beta2^t < 0.17``). An update differs relatively by at most
``(1 / sqrt(1 - beta2^t) - 1) * eps / sqrt(v / (1 - beta2^t))``, 3e-7 / |g| at t = 1 with
beta2 = 0.999 and eps = 1e-8: float rounding for unit-scale gradients, 3e-4 for |g| = 1e-3.
torch's AdamW takes one epsilon for all steps, so this is not matched.

``--adamw-impl``: ``fused`` (torch's ``fused=True``), ``foreach`` (``foreach=True``, one
multi-tensor op per step of the formula) or ``for-loop`` (per parameter). Unset, it is fused
where torch's fused AdamW takes the parameters' device and dtype, else foreach; one log line
says which runs and why. ``--adamw-impl fused`` on parameters fused refuses is an error. A
checkpoint keeps its hyper-parameters (as ``adam``'s, fairseq's ``--optimizer-overrides``
replaces them) but not its implementation: a resumed run uses its own ``--adamw-impl``.

Precision wrappers. ``--fp16`` and ``--bf16`` step fp32 master weights (``--fp16``: one flat
tensor, ``--fp16-no-flatten-grads`` and ``--bf16``: one per parameter), with fp32 moments, as
``adam``. ``--memory-efficient-bf16`` steps the bfloat16 parameters and, unlike ``adam``
(fp32 moments), keeps the moments in bfloat16: torch keeps the state in the parameters'
dtype; the fused kernel computes in fp32 and rounds parameters and moments to bfloat16
(foreach and for-loop compute in bfloat16). Checkpoints hold them as fp32 (fairseq's
``move_to_cpu`` upcasts 16-bit tensors) and loading casts them back, exactly. Fused, the wrappers'
pending gradient multiply (``1 / tokens``, clipping, the loss scale) is the kernel's ``grad_scale``
(fairseq's ``supports_step_with_scale``): it reads ``g / scale``, where the other implementations
get gradients multiplied by ``1 / scale`` in a pass of their own (a read and a write of every fp32
gradient; the kernel writes ``g / scale`` back, one write).
``--memory-efficient-fp16`` is refused: float16 moments underflow (``(1 - beta2) g^2`` is 0
for |g| below about 5e-3 at beta2 = 0.999) and the updates blow up.

``--optimizer sparse_clip --sparse-clip-base ts_adamw`` wraps it as any optimizer, and
``--zero-sharding os`` shards its state (the hidden gradients of parameters another rank
owns are skipped by torch's AdamW as by ``adam``). ``average_params`` (BMUF) is ``adam``'s.
"""

# no "from __future__ import annotations": fairseq reads the config's field types
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from fairseq.optim.adam import FairseqAdam
from omegaconf import II
from torch.optim.optimizer import _device_dtype_check_for_fused

from torchscale_fairseq.errors import TsConfigError

logger = logging.getLogger(__name__)

IMPLS = ("fused", "foreach", "for-loop")
ADAMW_IMPL_CHOICES = ChoiceEnum(list(IMPLS))
TORCH_IMPL_KWARGS = {"fused": {"fused": True, "foreach": False}, "foreach": {"fused": False, "foreach": True},
                     "for-loop": {"fused": False, "foreach": False}}


@dataclass
class TsAdamWConfig(FairseqDataclass):
    adam_betas: Any = field(default=(0.9, 0.999), metadata={"help": "betas for Adam optimizer"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for Adam optimizer"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay"})
    adamw_impl: Optional[ADAMW_IMPL_CHOICES] = field(
        default=None, metadata={"help": "torch AdamW implementation (default: fused where torch has it for the "
                                        "parameters' device and dtype, else foreach)"})
    lr: List[float] = II("optimization.lr")


class TorchAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with fairseq's capability flags; loading a state dict keeps this
    optimizer's implementation (``fused``/``foreach``), and torch casts the state to the
    parameters' device and dtype: fairseq's ``--memory-efficient-*`` loader, which restores the
    saved (fp32) state instead, is turned off (torch's kernels need the parameters' dtype)."""

    supports_flat_params = True
    supports_memory_efficient_fp16 = True  # bfloat16: TsAdamW refuses float16 parameters
    disable_mem_eff_fp16_loading_hack = True

    def load_state_dict(self, state_dict: dict) -> None:
        impl = {key: self.defaults[key] for key in ("fused", "foreach")}
        groups = [{**group, **impl} for group in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})

    @property
    def supports_step_with_scale(self) -> bool:
        """Fused: fairseq's fp16/bf16 wrappers hand the gradients' pending multiply to :meth:`step` as ``scale``
        rather than running it as a pass of its own over the fp32 gradients."""
        return bool(self.defaults["fused"])

    def step(self, closure: Optional[Callable] = None, scale: Union[float, torch.Tensor] = 1.0) -> Any:
        """One update with every gradient read as ``g / scale`` (torch's ``grad_scale``: the fused kernel divides
        in fp32 and writes ``g / scale`` back to the gradient), as fairseq's ``FP16Optimizer`` passes it."""
        if not torch.is_tensor(scale) and scale == 1.0:
            return super().step(closure)
        if not self.supports_step_with_scale:
            raise ValueError(f"{type(self).__name__}.step(scale=...) needs the fused implementation (this one is "
                             f"{'foreach' if self.defaults['foreach'] else 'for-loop'}): multiply the gradients instead")
        device = self.param_groups[0]["params"][0].device
        self.grad_scale = (scale.detach().to(device=device, dtype=torch.float32).reshape(1) if torch.is_tensor(scale)
                           else torch.full((1,), float(scale), dtype=torch.float32, device=device))
        try:
            return super().step(closure)
        finally:
            self.grad_scale = None


def choose_impl(requested: Optional[str], params: Iterable[torch.Tensor]) -> Tuple[str, str]:
    """The implementation to run on ``params`` for ``--adamw-impl requested``, and why."""
    if requested in ("foreach", "for-loop"):
        return requested, f"--adamw-impl {requested}"
    try:
        for p in params:
            _device_dtype_check_for_fused(p)
    except RuntimeError as refusal:
        if requested == "fused":
            raise TsConfigError(f"--adamw-impl fused: torch's fused AdamW refuses these parameters ({refusal}): "
                                "use --adamw-impl foreach or drop the flag") from None
        return "foreach", f"torch's fused AdamW refuses these parameters ({refusal})"
    return "fused", "--adamw-impl fused" if requested else "the default"


def check_hyper_parameters(config: dict) -> None:
    """One line for a value ``torch.optim.AdamW`` refuses, naming the flag."""
    betas = config["betas"]
    if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise TsConfigError(f"--adam-betas {betas} must be two numbers in [0, 1), e.g. '(0.9, 0.98)'")
    for flag, key in (("--adam-eps", "eps"), ("--weight-decay", "weight_decay"), ("--lr", "lr")):
        if not config[key] >= 0.0:
            raise TsConfigError(f"{flag} {config[key]} must be >= 0")


@register_optimizer("ts_adamw", dataclass=TsAdamWConfig)
class TsAdamW(FairseqOptimizer):
    """fairseq's ``adam`` as ``torch.optim.AdamW`` (module docstring)."""

    optimizer_config = FairseqAdam.optimizer_config
    average_params = FairseqAdam.average_params

    def __init__(self, cfg: TsAdamWConfig, params: Iterable[torch.Tensor]) -> None:
        super().__init__(cfg)
        params = list(params)
        if any(p.dtype == torch.float16 for p in params):
            raise TsConfigError("--optimizer ts_adamw keeps its moments in the parameters' dtype and float16 moments "
                                "underflow: use --fp16 or --memory-efficient-bf16 instead of --memory-efficient-fp16, "
                                "or --optimizer adam")
        try:
            config = self.optimizer_config
            config["betas"] = tuple(float(b) for b in config["betas"])
        except (SyntaxError, NameError, TypeError, ValueError):
            raise TsConfigError(f"--adam-betas {cfg.adam_betas!r} is not a pair of numbers: write it as "
                                "'(0.9, 0.98)'") from None
        check_hyper_parameters(config)
        impl, why = choose_impl(None if cfg.adamw_impl is None else str(cfg.adamw_impl), params)
        kinds = ", ".join(sorted({f"{p.device.type} {str(p.dtype).replace('torch.', '')}" for p in params}))
        logger.info(f"ts_adamw: torch.optim.AdamW {impl} on {len(params)} tensors ({kinds}): {why}")
        self._optimizer = TorchAdamW(params, **config, **TORCH_IMPL_KWARGS[impl])
