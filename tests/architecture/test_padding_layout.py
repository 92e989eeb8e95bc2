"""Padding layouts found on the host (:mod:`torchscale_fairseq.architecture.padding_layout`): the
layout against a per-row reading of the tokens, and stacks given marked tokens against the same
stacks testing the tokens themselves (outputs and gradients equal; no host read left in the stacks,
counted by ``benchmarks/step_overhead.py``'s sync counter with the model and tokens as device
tensors; the CPU's per-expert MoE loop reads its counts, outside the stacks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.model_utils import build, dictionary
from torchscale_fairseq.architecture.padding_layout import (
    INTERIOR,
    NONE,
    TRAILING,
    known_padding_layout,
    mark_padding_layout,
    padding_layout,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step_overhead as so  # noqa: E402

PAD = 1


def _by_rows(tokens: torch.Tensor) -> str:
    layouts = set()
    for row in tokens.tolist():
        pads = [t == PAD for t in row]
        if any(pads):
            first = pads.index(True)
            layouts.add(TRAILING if all(pads[first:]) else INTERIOR)
    return INTERIOR if INTERIOR in layouts else TRAILING if layouts else NONE


def test_layout_equals_a_per_row_reading():
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        tokens = torch.randint(4, 9, (3, 6), generator=g)
        for r in range(3):
            kind = int(torch.randint(0, 3, (), generator=g))
            cut = int(torch.randint(1, 6, (), generator=g))
            if kind == 1:
                tokens[r, cut:] = PAD
            elif kind == 2:
                tokens[r, :cut] = PAD
        layout = padding_layout(tokens, PAD)
        assert layout == _by_rows(tokens)
        seen.add(layout)
    assert seen == {NONE, TRAILING, INTERIOR}
    assert known_padding_layout(tokens) is None and known_padding_layout(mark_padding_layout(tokens, NONE)) == NONE


def _batches(d) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    none = torch.randint(d.nspecial, len(d), (3, 9), generator=g)
    trailing, interior = none.clone(), none.clone()
    trailing[1, 6:] = d.pad()
    interior[0, :3] = d.pad()
    return {NONE: none, TRAILING: trailing, INTERIOR: interior}


def _forward(model, marked: bool, layout: str, *tokens: torch.Tensor):
    tokens = [t.clone() for t in tokens]
    if marked:
        for t in tokens:
            mark_padding_layout(t, padding_layout(t, PAD))
    device = so.DeviceTensors()
    device.mark([model.parameters(), model.buffers(), tokens])
    torch.manual_seed(2)  # the same draws (X-MoE's random second expert) in both forwards
    with so.SyncCounter(device) as syncs:
        if len(tokens) == 1:
            out = model(tokens[0])[0]
        else:
            out = model(tokens[0], torch.full((tokens[0].size(0),), tokens[0].size(1)), tokens[1])[0]
        out.float().pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    stacks = sum(n for (_, site), n in syncs.sites.items() if site.startswith("torchscale_fairseq/architecture/"))
    return out.detach(), grads, stacks


@pytest.mark.parametrize("kind", ["lm", "lm_moe", "mt"])
def test_marked_tokens_give_the_tested_tokens_masks_without_a_host_read(kind):
    torch.set_num_threads(1)
    d = dictionary()
    assert d.pad() == PAD
    torch.manual_seed(0)
    sizes = dict(decoder_layers=1, decoder_embed_dim=32, decoder_ffn_embed_dim=64, dropout=0.0)
    if kind == "lm_moe":
        sizes.update(moe_expert_count=2, moe_freq=1)
    if kind == "mt":
        sizes.update(encoder_layers=1, encoder_embed_dim=32, encoder_ffn_embed_dim=64)
    model = build("mt" if kind == "mt" else "lm", d, **sizes).train()
    for layout, tokens in _batches(d).items():
        inputs = (tokens, _batches(d)[TRAILING]) if kind == "mt" else (tokens,)
        tested, tested_grads, tested_syncs = _forward(model, False, layout, *inputs)
        marked, marked_grads, marked_syncs = _forward(model, True, layout, *inputs)
        assert torch.equal(marked, tested), layout
        assert all(torch.equal(a, b) for a, b in zip(marked_grads, tested_grads)), layout
        assert tested_syncs >= 1 and marked_syncs == 0, (layout, tested_syncs, marked_syncs)
