"""Build ts models directly (no CLI) for unit tests."""

from __future__ import annotations

import argparse
from typing import Any

from fairseq.data import Dictionary

import torchscale_fairseq  # noqa: F401  (registers the models)
from torchscale_fairseq.models.lm import TsLanguageModel
from torchscale_fairseq.models.mlm import TsMaskedLMModel
from torchscale_fairseq.models.transformer import TsTransformerModel


class FakeTask:
    def __init__(self, dictionary: Dictionary) -> None:
        self.source_dictionary = self.target_dictionary = dictionary


def dictionary(n: int = 40) -> Dictionary:
    d = Dictionary()
    for i in range(n):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=8)
    return d


def args(**overrides: Any) -> argparse.Namespace:
    base = dict(
        backbone="magneto", activation_fn="gelu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_layers=2, decoder_attention_heads=4,
        encoder_embed_dim=64, encoder_ffn_embed_dim=128, encoder_layers=2, encoder_attention_heads=4,
        tokens_per_sample=64, max_target_positions=64, max_source_positions=64, max_positions=64,
        share_decoder_input_output_embed=True,
    )
    base.update(overrides)
    return argparse.Namespace(**base)


def build(kind: str, d: Dictionary = None, **overrides: Any):
    cls = {"lm": TsLanguageModel, "mt": TsTransformerModel, "mlm": TsMaskedLMModel}[kind]
    return cls.build_model(args(**overrides), FakeTask(d or dictionary()))
