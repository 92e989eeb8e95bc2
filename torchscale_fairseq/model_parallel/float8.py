"""FP8 training of the column/row-parallel linear layers through torchao's float8 training
(``--fp8 tensorwise|rowwise``; Micikevicius et al. 2022, "FP8 formats for deep learning").

Each converted layer's local GEMM ``x W_r^T`` (and its two backward GEMMs) runs as torchao's
``matmul_with_hp_or_float8_args`` with ``Float8LinearConfig.from_recipe_name(recipe)``: the
operands are cast with dynamic scales ``s = fp8_max / amax`` (per tensor, or per row along the
contraction dimension for ``rowwise``, scales rounded down to powers of two) and multiplied by
``torch._scaled_mm``. That is the function ``torchao.float8.convert_to_float8_training``'s
``Float8Linear`` calls; that converter swaps ``nn.Linear`` modules only, and ours are
Megatron-style modules whose collectives surround the local GEMM, so the GEMM is swapped inside
them instead. Under tensor parallelism each rank scales its own shards (local amax, no
collective), so FP8 at N ranks equals FP8 of each shard's GEMM, not of the unsharded one.

Which layers convert follows torchao's ``_auto_filter_for_recipe`` on the local shard's
``(N, K) = weight.shape``: both multiples of 16 (``_scaled_mm``), and above its H100 speed
thresholds. The output layer is not a linear module (``parallel_logits``, the fused loss) and
stays in high precision, as torchao advises. Expert GEMMs are refused (:func:`fp8_refusal`).
torchao is optional: imported only here, when a run asks for FP8.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torchscale_fairseq.model_parallel.process_groups import group_size

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first with FP8 tensor cores (torch._scaled_mm)
TORCHAO_PIP = "pip install torchao==0.17.0"  # the release built against torch 2.11 (ABI-stable from there on)

ModuleFilter = Callable[[str, nn.Module], bool]


def fp8_shape_rule(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao's ``_auto_filter_for_recipe`` on a GEMM with weight ``(N, K)``: ``N, K`` multiples of
    16, and not below the sizes where FP8 was slower on an H100 (tensorwise: not ``K <= 4096 and
    N <= 1024``; rowwise: ``N > 2048``, ``K > 1024`` and not ``N <= 4096 and K <= 2048``)."""
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    if recipe == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    raise TsConfigError(f"--fp8 {recipe!r} is not a recipe: choose one of {', '.join(FP8_RECIPES)}")


def fp8_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's column/row-parallel linear layers, by qualified name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def default_fp8_filter(recipe: str) -> ModuleFilter:
    """:func:`fp8_shape_rule` on a layer's local weight shard."""
    return lambda name, module: fp8_shape_rule(recipe, *module.weight.shape)


#: FP8 changes only the GEMMs, not the parameters, so an FP8-trained checkpoint evaluates without it.
EVAL_HINT = " (to evaluate an --fp8 checkpoint on this device: --model-overrides \"{'fp8': 'none'}\")"


def fp8_refusal(device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why FP8 cannot run on this device (one line), or None. ``capability``: the CUDA device's
    compute capability."""
    if device_type != "cuda":
        return ("--fp8 needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper), not the CPU: "
                f"drop --fp8{EVAL_HINT}")
    if capability is None or tuple(capability) < FP8_MIN_CAPABILITY:
        have = "unknown" if capability is None else "%d.%d" % tuple(capability)
        return (f"--fp8 needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper); this GPU has {have}: "
                f"drop --fp8{EVAL_HINT}")
    return None


def import_torchao_float8():
    """torchao's float8 training module, or a one-line error naming the pip command."""
    try:
        import torchao.float8 as float8
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    except ImportError as e:
        raise TsConfigError(f"--fp8 needs torchao's float8 training, which does not import ({e}): {TORCHAO_PIP}") from e
    return float8, matmul_with_hp_or_float8_args


class Float8Gemm:
    """``x W^T + b`` with torchao's float8 matmul in the recipe's config (the body of torchao's
    ``Float8Linear.forward``); ``emulate`` multiplies the dequantised operands in fp32 instead of
    ``torch._scaled_mm`` (torchao's CPU path, for tests)."""

    def __init__(self, recipe: str, emulate: bool = False) -> None:
        float8, self._matmul = import_torchao_float8()
        self.recipe = recipe
        self.config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        c = self.config
        self.mm_config = float8.LinearMMConfig(*(
            float8.ScaledMMConfig(c.emulate, gemm.use_fast_accum, False, c.pad_inner_dim)
            for gemm in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        ))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = self._matmul.apply(x, weight.t(), self.mm_config, self.config)
        return y if bias is None else y + bias.to(y.dtype)

    def __repr__(self) -> str:
        return f"Float8Gemm({self.recipe}{', emulated' if self.config.emulate else ''})"


def convert_to_fp8(model: nn.Module, recipe: str, *, module_filter: ModuleFilter | None = None,
                   emulate: bool = False) -> list[str]:
    """Give each column/row-parallel linear of ``model`` that ``module_filter`` (default:
    :func:`default_fp8_filter`) accepts a :class:`Float8Gemm`; returns the converted names."""
    if recipe not in FP8_RECIPES:
        raise TsConfigError(f"--fp8 {recipe!r} is not a recipe: choose one of {', '.join(FP8_RECIPES)}")
    keep = module_filter or default_fp8_filter(recipe)
    gemm = Float8Gemm(recipe, emulate=emulate)
    converted = []
    for name, module in fp8_linears(model):
        if module.sequence_parallel and group_size(module.tp_group) > 1:
            raise TsConfigError("--fp8 does not run the sequence-parallel GEMMs yet: drop --fp8 or --sequence-parallel")
        if keep(name, module):
            module.gemm = gemm
            converted.append(name)
    return converted
