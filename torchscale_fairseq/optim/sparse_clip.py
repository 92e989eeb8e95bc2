"""``--optimizer sparse_clip``: SparseClip (TorchScale paper, section 2.3) around any
registered fairseq optimizer (``--sparse-clip-base``, default ``adam``, with its own flags).

    ||g|| = ||(g_d, kappa * g_s)||_2,  kappa = 1 / sqrt(E)   (--sparse-clip-kappa overrides)
    g <- xi / max(xi, ||g||) * g       for all gradients, xi = --clip-norm

The norm comes from :func:`torchscale_fairseq.optim.grad_norm.grad_norm` (every gradient
counted once under data, expert and tensor parallelism) over the groups of ``parallel``, the
run's context the trainer gives it. Unlike the paper's public
sample code, kappa is ``1/sqrt(E)`` (not ``1/sqrt(max(world, E))``) and the real expert
gradients are clipped (not a detached copy). Without experts it is vanilla clipping.

Precision modes: fairseq's fp16/bf16 wrappers call ``clip_grad_norm(0)`` on loss-scaled
gradients and clip through their ``_multiply_factor``; the norm's parts are kept in
``last_norm`` and the trainer (:mod:`torchscale_fairseq.integration.trainer`) logs them
times that factor, so every logged norm is taken on unscaled gradients. ``--fp16``'s flat
fp32 master is split back into per-parameter views, so experts are still recognised. A
non-finite norm is returned as it is: the loss scaler (fp16) or the trainer (fp32, bf16)
skips the update.

Flags: ``--sparse-clip-base`` and the flags of every registered optimizer, with their
defaults suppressed, so the base's own flags parse without knowing the base yet; the
base's dataclass supplies the defaults, and a flag of another optimizer is refused by the
trainer before training (:func:`check_foreign_flags`).

Logged: ``gnorm`` (the SparseClip norm, by fairseq), ``gnorm_dense``, ``gnorm_expert``
(by the trainer) and ``clip`` (by fairseq: percentage of updates where ``||g|| > xi``).
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.optim import (
    OPTIMIZER_DATACLASS_REGISTRY,
    OPTIMIZER_REGISTRY,
    FairseqOptimizer,
    build_optimizer,
    register_optimizer,
)
from omegaconf import OmegaConf, open_dict

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.optim.grad_norm import GradNorm, norm_and_clip_

NAME = "sparse_clip"


def check_base(name: str) -> None:
    if name == NAME or name not in OPTIMIZER_REGISTRY:
        choices = ", ".join(sorted(k for k in OPTIMIZER_REGISTRY if k != NAME))
        raise TsConfigError(f"--sparse-clip-base {name!r} is not a fairseq optimizer to wrap: choose one of {choices}")


class _BaseChoice(argparse.Action):
    """``--sparse-clip-base NAME``, refused with one line unless NAME is a registered optimizer."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        check_base(value)
        setattr(namespace, self.dest, value)


def optimizer_flags(name: str) -> list[argparse.Action]:
    """The command-line flags of the registered optimizer ``name``."""
    parser = argparse.ArgumentParser(add_help=False)
    cls = OPTIMIZER_REGISTRY[name]
    dc = getattr(cls, "__dataclass", None)
    if dc is not None:
        gen_parser_from_dataclass(parser, dc())
    else:
        cls.add_args(parser)
    return [a for a in parser._actions if a.option_strings]


def add_base_optimizer_flags(parser: argparse.ArgumentParser) -> None:
    """Every registered optimizer's flags that ``parser`` lacks, defaults suppressed."""
    for name in sorted(OPTIMIZER_REGISTRY):
        if name == NAME:
            continue
        for action in optimizer_flags(name):
            if any(o in parser._option_string_actions for o in action.option_strings):
                continue
            common = {"dest": action.dest, "help": action.help, "default": argparse.SUPPRESS}
            if action.nargs == 0:
                parser.add_argument(*action.option_strings, action="store_const", const=action.const, **common)
            else:
                parser.add_argument(*action.option_strings, type=action.type, nargs=action.nargs,
                                    choices=action.choices, metavar=action.metavar, **common)


def check_foreign_flags(args) -> None:
    """One line if a flag of another optimizer than the base was given (parsed flags:
    their defaults are suppressed, so a flag present was given)."""
    base = getattr(args, "sparse_clip_base", None)
    if getattr(args, "optimizer", None) != NAME or base is None:
        return
    own = {a.dest for a in optimizer_flags(base)}
    for name in sorted(OPTIMIZER_REGISTRY):
        if name in (NAME, base):
            continue
        for action in optimizer_flags(name):
            if action.dest not in own and action.dest in vars(args):
                raise TsConfigError(
                    f"{action.option_strings[0]} is a flag of --optimizer {name}, not of --sparse-clip-base {base}: "
                    f"drop it or use --sparse-clip-base {name}"
                )


def base_config(args) -> object:
    """The base optimizer's config from the flat flags: a DictConfig of its dataclass
    (as fairseq builds it, so tuples become lists) or, for a legacy optimizer, the flags."""
    name = args.sparse_clip_base
    dc = OPTIMIZER_DATACLASS_REGISTRY.get(name)
    if dc is None:
        legacy = copy.copy(args)
        for action in optimizer_flags(name):
            if action.dest not in vars(legacy):
                setattr(legacy, action.dest, action.default)
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


@register_optimizer(NAME)
class SparseClip(FairseqOptimizer):
    def __init__(self, args, params) -> None:
        super().__init__(args)
        check_base(args.sparse_clip_base)
        self.base = build_optimizer(base_config(args), params)
        self._optimizer = self.base.optimizer
        self.kappa = sparse_clip_kappa(getattr(args, "moe_expert_count", 0) or 0, args.sparse_clip_kappa)
        self.last_norm: GradNorm | None = None
        self.parallel: ParallelContext | None = None  # the run's, given by the trainer (None: one process)

    @classmethod
    def add_args(cls, parser) -> None:
        parser.add_argument("--sparse-clip-base", default="adam", metavar="OPTIMIZER", action=_BaseChoice,
                            help="the fairseq optimizer SparseClip wraps (its flags apply)")
        parser.add_argument("--sparse-clip-kappa", type=float, default=-1.0, metavar="K",
                            help="expert-gradient weight in the norm (default 1/sqrt(--moe-expert-count))")
        add_base_optimizer_flags(parser)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.base.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace the base's torch optimizer (``--zero-sharding os`` does)."""
        self.base.optimizer = optimizer
        self._optimizer = optimizer

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
        """SparseClip norm of the current gradients (its parts kept in ``last_norm``);
        clips them when ``max_norm > 0`` and the norm is finite."""
        params = [p for p in self.params if p.grad is not None]
        if not params:
            self.last_norm = None
            return torch.tensor(0.0)
        self.last_norm, total = norm_and_clip_(params, max_norm, self.parallel, self.kappa, aggregate_norm_fn)
        return total
