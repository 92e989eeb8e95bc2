"""Residual/normalisation schemes and their initialisation constants.

- ``postln``: ``x = LN(x + f(x))``;  ``preln``: ``x = x + f(LN(x))``
- ``deepnorm`` (DeepNet): ``x = LN(alpha * x + f(x))``, weights of v/out/fc1/fc2 times beta
- ``magneto`` (Sub-LN): Pre-LN plus an inner LayerNorm before the attention output
  projection and before ``fc2``; weights of v/out/fc1/fc2 times gamma

Constants (N encoder layers, M decoder layers; DeepNet paper Table 1, TorchScale paper
section 1.2; the README's backbone table):

==================  ======================  ======================  ==========================
part                DeepNorm alpha          DeepNorm beta           Sub-LN gamma
==================  ======================  ======================  ==========================
encoder/decoder     (2N)^(1/4)              (8N)^(-1/4)             sqrt(ln 2N)
only
enc-dec encoder     0.81 (N^4 M)^(1/16)     0.87 (N^4 M)^(-1/16)    sqrt(ln(3M) ln(2N) / 3)
enc-dec decoder     (3M)^(1/4)              (12M)^(-1/4)            sqrt(ln 3M)
==================  ======================  ======================  ==========================

The encoder beta uses the DeepNet paper's 0.87 (public TorchScale code: 1.15).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchscale_fairseq.errors import TsConfigError

BACKBONES = ("magneto", "deepnorm", "preln", "postln")
PARTS = ("encoder_only", "decoder_only", "encdec_encoder", "encdec_decoder")


@dataclass(frozen=True)
class Backbone:
    """A backbone with the residual scale ``alpha`` and the init gain of v/out/fc1/fc2."""

    name: str
    alpha: float = 1.0
    gain: float = 1.0

    @property
    def normalize_before(self) -> bool:
        return self.name in ("magneto", "preln")

    @property
    def subln(self) -> bool:
        return self.name == "magneto"


def check_backbone(name: str) -> None:
    if name not in BACKBONES:
        raise TsConfigError(f"--backbone {name!r} is unknown: choose one of {', '.join(BACKBONES)}")


def build_backbone(name: str, part: str, encoder_layers: int = 0, decoder_layers: int = 0) -> Backbone:
    """The constants of backbone ``name`` for one ``part`` of a model of the given depth."""
    check_backbone(name)
    if part not in PARTS:
        raise TsConfigError(f"unknown model part {part!r}: expected one of {PARTS}")
    n, m = encoder_layers, decoder_layers
    depth = n if part == "encoder_only" else m
    if name in ("preln", "postln"):
        return Backbone(name)
    if name == "deepnorm":
        if part in ("encoder_only", "decoder_only"):
            return Backbone(name, alpha=(2 * depth) ** 0.25, gain=(8 * depth) ** -0.25)
        if part == "encdec_encoder":
            return Backbone(name, alpha=0.81 * (n**4 * m) ** (1 / 16), gain=0.87 * (n**4 * m) ** (-1 / 16))
        return Backbone(name, alpha=(3 * m) ** 0.25, gain=(12 * m) ** -0.25)
    if part in ("encoder_only", "decoder_only"):
        return Backbone(name, gain=math.sqrt(math.log(2 * depth)))
    if part == "encdec_encoder":
        return Backbone(name, gain=math.sqrt(math.log(3 * m) * math.log(2 * n) / 3))
    return Backbone(name, gain=math.sqrt(math.log(3 * m)))
