"""A pipeline stage is what it holds: its parameters are named, ordered and valued as those of a
one-process model built independently, restricted to the stage (its layers by global index, the
first stage the embedding, the last every other tensor and a tied embedding's copy, last); one
process's order comes back from the stages' orders (``ts_mlm``'s head bias, a last-stage tensor,
first), and orders that do not determine it are one line."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tests.helpers.model_utils import args, dictionary
from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.decoder import TransformerDecoder
from torchscale_fairseq.architecture.embedding import build_token_embedding
from torchscale_fairseq.checkpoints.convert import one_process_order
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.model_parallel.pipeline_parallel import PipelineSplit
from torchscale_fairseq.models.mlm import MaskedLMEncoder

LAYERS = 4
SPLITS = {  # name: (pipeline size, virtual stages, layers per global stage)
    "p2": (2, 1, None),
    "p2_uneven": (2, 1, [1, 3]),
    "p2_v2": (2, 2, None),
    "p4": (4, 1, None),
}


def _lm(split: PipelineSplit | None, tied: bool) -> dict[str, torch.Tensor]:
    """``ts_lm``'s decoder (its parameters by name, in order), seeded as one run does."""
    d = dictionary()
    cfg = StackConfig.from_args(args(decoder_layers=LAYERS, share_decoder_input_output_embed=tied), "decoder",
                                "decoder_only", ParallelContext.single_process())
    torch.manual_seed(0)
    embed_tokens = build_token_embedding(len(d), cfg.embed_dim, d.pad(), None)
    decoder = TransformerDecoder(dataclasses.replace(cfg, pipeline=split), d, embed_tokens, cross_attention=False)
    return dict(decoder.named_parameters())


def _mlm(split: PipelineSplit | None, tied: bool = True) -> dict[str, torch.Tensor]:
    """``ts_mlm``'s encoder and BERT head (its output embedding always tied)."""
    cfg = StackConfig.from_args(args(encoder_layers=LAYERS), "encoder", "encoder_only", ParallelContext.single_process())
    torch.manual_seed(0)
    return dict(MaskedLMEncoder(dataclasses.replace(cfg, pipeline=split), dictionary()).named_parameters())


# (build, stack prefix, tied copy, embedding): names written out, not read from the code under test
MODELS = {
    "lm": (_lm, "", "tied_output.weight", "embed.embed_tokens.weight"),
    "mlm": (_mlm, "encoder.", "tied_output.weight", "encoder.embed.embed_tokens.weight"),
}


def _restricted(whole: dict[str, torch.Tensor], stack: str, split: PipelineSplit) -> list[str]:
    """One process's names held by the stage ``split``: its layers, the embedding on the first stage,
    every other tensor on the last."""
    held = {i for r in split.chunk_layers for i in r}
    names = []
    for name in whole:
        layer = re.match(rf"^{re.escape(stack)}layers\.(\d+)\.", name)
        if layer is not None:
            keep = int(layer.group(1)) in held
        else:
            keep = split.holds_first_stage if name.startswith(f"{stack}embed.") else split.holds_last_stage
        if keep:
            names.append(name)
    return names


@pytest.mark.parametrize("model,tied", [("lm", True), ("lm", False), ("mlm", True)])  # ts_mlm: always tied
@pytest.mark.parametrize("layout", list(SPLITS))
def test_stage_names_order_and_values_are_one_process_restricted(model, layout, tied):
    build, stack, copy, embedding = MODELS[model]
    size, virtual, counts = SPLITS[layout]
    whole = build(None, tied)
    assert all(f"{stack}layers.{i}." in " ".join(whole) for i in range(LAYERS))
    for rank in range(size):
        split = PipelineSplit.for_rank(LAYERS, size, rank, virtual, counts)
        stage = build(split, tied)
        want = _restricted(whole, stack, split) + ([copy] if tied and split.holds_last_stage else [])
        assert list(stage) == want, (rank, list(stage))
        for name, param in stage.items():
            assert torch.equal(param, whole[embedding if name == copy else name]), (rank, name)


@pytest.mark.parametrize("model", list(MODELS))
def test_one_process_order_from_the_stages_orders(model):
    build, _, copy, _ = MODELS[model]
    whole = list(build(None, True))
    orders = [[n for n in build(PipelineSplit.for_rank(LAYERS, 2, rank, 2), True) if n != copy] for rank in (0, 1)]
    assert orders[1][0] == ("lm_head_bias" if model == "mlm" else "layers.1.self_attn.qkv_proj.weight")
    assert one_process_order(orders) == whole
    assert one_process_order(orders[::-1]) == whole


def test_orders_that_do_not_determine_one_are_one_line():
    with pytest.raises(TsConfigError, match=r"^the stages' tensor orders do not give one order of the model's a, b, "
                                            r"layers: stages from"):
        one_process_order([["a.w", "layers.0.w"], ["b.w", "layers.1.w"]])
