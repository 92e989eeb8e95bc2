"""``--optimizer sparse_clip``: SparseClip (TorchScale paper, section 2.3) around any
registered fairseq optimizer (``--sparse-clip-base``, default ``adam``, with its own flags).

    ||g|| = ||(g_d, kappa * g_s)||_2,  kappa = 1 / sqrt(E)   (--sparse-clip-kappa overrides)
    g <- xi / max(xi, ||g||) * g       for all gradients, xi = --clip-norm

The norm comes from :func:`torchscale_fairseq.optim.grad_norm.grad_norm` (every gradient
counted once under data, expert and tensor parallelism). Unlike the paper's public
sample code, kappa is ``1/sqrt(E)`` (not ``1/sqrt(max(world, E))``) and the real expert
gradients are clipped (not a detached copy). Without experts it is vanilla clipping.

Precision modes: fairseq's fp16/bf16 wrappers call ``clip_grad_norm(0)`` on loss-scaled
gradients, multiply the returned norm by their ``_multiply_factor`` and clip through that
factor; the logged parts are multiplied by the same factor, so every logged norm is
taken on unscaled gradients. ``--fp16``'s flat fp32 master is split back into
per-parameter views (:mod:`torchscale_fairseq.compat.grad_norm_clip`), so experts are
still recognised. A non-finite norm raises ``OverflowError`` (fairseq skips the update)
unless a loss scaler (fp16, AMP) handles the overflow itself.

Logged: ``gnorm`` (the SparseClip norm, by fairseq), ``gnorm_dense``, ``gnorm_expert``
and ``clip`` (by fairseq: percentage of updates where ``||g|| > xi``).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import math
import sys

import torch
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.logging import metrics
from fairseq.optim import (
    OPTIMIZER_DATACLASS_REGISTRY,
    OPTIMIZER_REGISTRY,
    FairseqOptimizer,
    build_optimizer,
    register_optimizer,
)
from omegaconf import OmegaConf, open_dict

from torchscale_fairseq.compat.grad_norm_clip import _views as flat_master_views
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.optim.grad_norm import clip_grads_, grad_norm

NAME = "sparse_clip"


def _argv_being_parsed() -> list[str]:
    """The argument list fairseq's ``parse_args_and_arch`` is parsing (``sys.argv`` from
    the console tools), so that the base optimizer's flags can be added before the final
    parse."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "parse_args_and_arch" and "input_args" in frame.f_locals:
            given = frame.f_locals["input_args"]
            return sys.argv[1:] if given is None else [str(a) for a in given]
        frame = frame.f_back
    return sys.argv[1:]


def base_name_from_argv(argv: list[str]) -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--sparse-clip-base", default="adam")
    return pre.parse_known_args(argv)[0].sparse_clip_base


def check_base(name: str) -> None:
    if name == NAME or name not in OPTIMIZER_REGISTRY:
        choices = ", ".join(sorted(k for k in OPTIMIZER_REGISTRY if k != NAME))
        raise TsConfigError(f"--sparse-clip-base {name!r} is not a fairseq optimizer to wrap: choose one of {choices}")


def base_config(args) -> object:
    """The base optimizer's config from the flat flags: a DictConfig of its dataclass
    (as fairseq builds it, so tuples become lists) or, for a legacy optimizer, the flags."""
    name = args.sparse_clip_base
    dc = OPTIMIZER_DATACLASS_REGISTRY.get(name)
    if dc is None:
        legacy = copy.copy(args)
        legacy.optimizer = legacy._name = name
        return legacy
    values = dc.from_namespace(args)
    for key, value in vars(values).items():
        if isinstance(value, str) and value.startswith("${"):
            setattr(values, key, getattr(args, value[2:-1].split(".")[-1], None))
    cfg = OmegaConf.structured(values)
    with open_dict(cfg):
        cfg._name = name
    return cfg


def sparse_clip_kappa(expert_count: int, override: float | None = None) -> float:
    """``1/sqrt(E)`` (paper eq. 4), 1 without experts; ``override`` when given (>= 0)."""
    if override is not None and override >= 0:
        return float(override)
    return 1.0 / math.sqrt(expert_count) if expert_count > 0 else 1.0


def _caller() -> object:
    """The object whose method called ``clip_grad_norm`` (a trainer or a precision wrapper)."""
    return sys._getframe(2).f_locals.get("self")


@register_optimizer(NAME)
class SparseClip(FairseqOptimizer):
    def __init__(self, args, params) -> None:
        super().__init__(args)
        check_base(args.sparse_clip_base)
        self.base = build_optimizer(base_config(args), params)
        self._optimizer = self.base.optimizer
        self.kappa = sparse_clip_kappa(getattr(args, "moe_expert_count", 0) or 0, args.sparse_clip_kappa)

    @classmethod
    def add_args(cls, parser) -> None:
        parser.add_argument("--sparse-clip-base", default="adam", metavar="OPTIMIZER",
                            help="the fairseq optimizer SparseClip wraps (its flags apply)")
        parser.add_argument("--sparse-clip-kappa", type=float, default=-1.0, metavar="K",
                            help="expert-gradient weight in the norm (default 1/sqrt(--moe-expert-count))")
        base = base_name_from_argv(_argv_being_parsed())
        check_base(base)
        base_cls = OPTIMIZER_REGISTRY[base]
        dc = getattr(base_cls, "__dataclass", None)
        if dc is not None:
            gen_parser_from_dataclass(parser, dc())
        else:
            base_cls.add_args(parser)

    @property
    def optimizer_config(self) -> dict:
        return self.base.optimizer_config

    @property
    def supports_memory_efficient_fp16(self) -> bool:
        return self.base.supports_memory_efficient_fp16

    @property
    def supports_step_with_scale(self) -> bool:
        return self.base.supports_step_with_scale

    @property
    def supports_groups(self) -> bool:
        return self.base.supports_groups

    @property
    def supports_flat_params(self) -> bool:
        return self.base.supports_flat_params

    def step(self, closure=None, scale: float = 1.0, groups=None):
        if self.base.supports_step_with_scale:
            return self.base.step(closure, scale=scale, groups=groups)
        return self.base.step(closure, groups=groups)

    def average_params(self) -> None:
        self.base.average_params()

    def clip_grad_norm(self, max_norm: float, aggregate_norm_fn=None) -> torch.Tensor:
        """SparseClip norm of the current gradients; clips them when ``max_norm > 0``."""
        params = [p for p in self.params if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        norm = grad_norm(list(flat_master_views(params)), self.kappa)
        total = norm.total.to(params[0].grad.device)
        if aggregate_norm_fn is not None:
            total = aggregate_norm_fn(total)
        caller = _caller()
        factor = getattr(caller, "_multiply_factor", 1.0)
        factor = float(factor) if torch.is_tensor(factor) else factor
        metrics.log_scalar("gnorm_dense", float(norm.dense) * factor, priority=710, round=3)
        metrics.log_scalar("gnorm_expert", float(norm.expert) * factor, priority=720, round=3)
        if not torch.isfinite(total):
            handled = getattr(caller, "scaler", None) is not None
            if not handled:
                raise OverflowError(f"non-finite SparseClip gradient norm {float(total)}")
            return total
        if max_norm > 0:
            clip_grads_(params, float(max_norm), total)
        return total
