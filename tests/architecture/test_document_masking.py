"""Document-masked packing (``--document-masking``, ``--reset-positions-at-documents``): a packed
block scores as its documents run one by one, the reference being each document alone through
the plain model (no document ids) in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers.model_utils import FakeTask, args, dictionary
from torchscale_fairseq.architecture import layer
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.models.config import check_document_masking
from torchscale_fairseq.models.lm import TsLanguageModel
from torchscale_fairseq.models.mlm import TsMaskedLMModel
from torchscale_fairseq.modules.document_mask import document_attention_mask
from torchscale_fairseq.modules.positions import document_positions

LENGTHS = [5, 9, 3, 7]  # one packed block of 24 tokens


class DocumentTask(FakeTask):
    document_masking = True


def build(cls, **overrides):
    torch.manual_seed(0)
    d = dictionary()
    return cls.build_model(args(**overrides), DocumentTask(d)).double(), d


def ids_of(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]


def lm_documents(d, lengths: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, target) of each document alone: source = ``</s>`` + target[:-1], as in a stream."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        target = torch.randint(d.nspecial, len(d), (1, n), generator=g)
        docs.append((torch.cat([torch.full((1, 1), d.eos()), target[:, :-1]], 1), target))
    return docs


def lm_loss(model, d, source, target, **kwargs) -> torch.Tensor:
    logits = model(source, **kwargs)[0][..., : len(d)]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")


def packed_and_alone(model, d, docs, lengths):
    """Per-token losses of the packed block with document ids, and of each document alone."""
    source, target = torch.cat([s for s, _ in docs], 1), torch.cat([t for _, t in docs], 1)
    packed = lm_loss(model, d, source, target, document_ids=ids_of(lengths))
    alone = torch.cat([lm_loss(model, d, s, t) for s, t in docs])
    return packed, alone


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


@pytest.mark.parametrize("positions", [{"decoder_learned_pos": True}, {}], ids=["learned", "sinusoidal"])
def test_lm_packed_block_equals_documents_alone_with_position_reset(positions: dict) -> None:
    model, d = build(TsLanguageModel, reset_positions_at_documents=True, **positions)
    docs = lm_documents(d, LENGTHS)
    packed, alone = packed_and_alone(model, d, docs, LENGTHS)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)
    packed.sum().backward()
    g_packed = grads(model)
    alone.sum().backward()
    g_alone = grads(model)
    assert g_packed.keys() == g_alone.keys() and g_packed
    for name in g_packed:
        torch.testing.assert_close(g_packed[name], g_alone[name], rtol=1e-9, atol=1e-10, msg=name)
    # the reference would catch a missing mask: plain causal attention over the block differs
    source, target = torch.cat([s for s, _ in docs], 1), torch.cat([t for _, t in docs], 1)
    assert not torch.allclose(lm_loss(model, d, source, target), alone)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_keeps_the_document_mask(mode: str) -> None:
    """``--checkpoint-activations``: the recomputed layers / attention cores see the same mask."""
    model, d = build(TsLanguageModel, reset_positions_at_documents=True, decoder_learned_pos=True,
                     checkpoint_activations=mode)
    packed, alone = packed_and_alone(model, d, lm_documents(d, LENGTHS), LENGTHS)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)
    packed.sum().backward()
    g_packed = grads(model)
    alone.sum().backward()
    for name, grad in grads(model).items():
        torch.testing.assert_close(g_packed[name], grad, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("relative", [{"xpos": True}, {"rel_pos_buckets": 16}], ids=["xpos", "rel_bias"])
def test_lm_relative_positions_need_no_reset(relative: dict) -> None:
    """xPos and the relative bias depend on i - j only: masking alone gives each document's loss."""
    model, d = build(TsLanguageModel, no_token_positional_embeddings=True, **relative)
    packed, alone = packed_and_alone(model, d, lm_documents(d, LENGTHS), LENGTHS)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)


def test_lm_without_reset_documents_are_isolated() -> None:
    """Absolute positions kept: the first document is as alone, and no document's loss depends on
    another's tokens."""
    model, d = build(TsLanguageModel, decoder_learned_pos=True)
    docs, other = lm_documents(d, LENGTHS, seed=1), lm_documents(d, LENGTHS, seed=2)
    packed, alone = packed_and_alone(model, d, docs, LENGTHS)
    torch.testing.assert_close(packed[: LENGTHS[0]], alone[: LENGTHS[0]], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(packed[LENGTHS[0]:], alone[LENGTHS[0]:])  # later documents keep their offsets
    for k in range(len(LENGTHS)):
        mixed = [docs[k] if i == k else other[i] for i in range(len(LENGTHS))]
        loss, _ = packed_and_alone(model, d, mixed, LENGTHS)
        lo, hi = sum(LENGTHS[:k]), sum(LENGTHS[: k + 1])
        torch.testing.assert_close(loss[lo:hi], packed[lo:hi], rtol=1e-10, atol=1e-10)


def test_mlm_packed_block_equals_documents_alone() -> None:
    """Bidirectional: each segment's logits equal the segment's alone; a right-padded row too."""
    model, d = build(TsMaskedLMModel, reset_positions_at_documents=True, encoder_learned_pos=True)
    g = torch.Generator().manual_seed(3)
    segments = [torch.randint(d.nspecial, len(d), (1, n), generator=g) for n in LENGTHS]
    block = torch.cat(segments, 1)
    padded = torch.cat([block[:, :-4], torch.full((1, 4), d.pad())], 1)
    ids = ids_of(LENGTHS)
    logits = model(torch.cat([block, padded]), document_ids=torch.cat([ids, ids]))[0]
    alone = torch.cat([model(s)[0] for s in segments], 1)
    torch.testing.assert_close(logits[:1], alone, rtol=1e-10, atol=1e-10)
    alone_cut = torch.cat([model(s)[0] for s in segments[:-1]] + [model(segments[-1][:, :-4])[0]], 1)
    torch.testing.assert_close(logits[1, :-4], alone_cut[0], rtol=1e-10, atol=1e-10)


def test_mask_and_positions_against_loops() -> None:
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    tokens = torch.full_like(ids, 9)
    tokens[1, -2:] = 1  # pads (padding_idx 1)
    for causal in (True, False):
        mask = document_attention_mask(ids, causal, torch.bfloat16)
        assert mask.dtype == torch.bfloat16 and mask.shape == (2, 1, 6, 6)
        assert mask.stride(2) % 8 == 0 and mask.stride(0) % 8 == 0  # CUDA's memory-efficient SDPA takes it as is
        for b in range(2):
            for i in range(6):
                for j in range(6):
                    allowed = ids[b, i] == ids[b, j] and (j <= i or not causal)
                    assert float(mask[b, 0, i, j]) == (0.0 if allowed else float("-inf"))
    expected = torch.tensor([[2, 3, 2, 3, 4, 2], [2, 2, 3, 4, 1, 1]])
    assert torch.equal(document_positions(tokens, ids, 1), expected)


def test_compiled_layers_match_eager(monkeypatch) -> None:
    """``--ts-compile``: the compiled layers take the document mask as a graph input, same result
    (dynamo and AOT autograd as ``--ts-compile`` runs them; the ``aot_eager`` backend skips
    inductor's C++ build, which tests/architecture/test_ts_compile.py covers)."""
    torch.set_num_threads(1)
    aot = torch.compile(layer.TransformerLayer._forward, backend="aot_eager")
    monkeypatch.setattr(layer, "_compiled_forward", lambda: aot)
    small = dict(reset_positions_at_documents=True, decoder_learned_pos=True, decoder_embed_dim=32,
                 decoder_ffn_embed_dim=64)
    eager, d = build(TsLanguageModel, **small)
    compiled, _ = build(TsLanguageModel, ts_compile=True, **small)
    eager, compiled = eager.float().eval(), compiled.float().eval()
    compiled.load_state_dict(eager.state_dict())
    docs = lm_documents(d, LENGTHS)
    source = torch.cat([s for s, _ in docs], 1).repeat(2, 1)
    ids = ids_of(LENGTHS).repeat(2, 1)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        got, expected = compiled(source, document_ids=ids)[0], eager(source, document_ids=ids)[0]
    assert counters["stats"]["unique_graphs"] >= 1  # the layers did run through dynamo
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags, masking, message", [
    ({"reset_positions_at_documents": True}, False, "needs blocks that carry their documents"),
    ({"reset_positions_at_documents": True, "no_token_positional_embeddings": True}, True, "has none"),
])
def test_refusals(flags: dict, masking: bool, message: str) -> None:
    with pytest.raises(TsConfigError, match=message):
        check_document_masking(args(**flags), masking)
