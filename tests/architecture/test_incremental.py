"""Incremental decoding with the KV cache equals the full forward pass."""

import pytest
import torch

from tests.helpers.model_utils import build, dictionary

VARIANTS = [
    dict(),
    dict(backbone="deepnorm"),
    dict(backbone="postln", decoder_learned_pos=True, encoder_learned_pos=True),
    dict(rel_pos_buckets=16),
    dict(xpos=True),
    dict(activation_fn="swiglu", share_decoder_input_output_embed=False),
]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "magneto")
def test_lm_incremental_equals_full(overrides):
    torch.manual_seed(0)
    d = dictionary()
    model = build("lm", d, **overrides).eval()
    tokens = torch.randint(d.nspecial, len(d), (3, 14))
    with torch.no_grad():
        full = model(tokens)[0]
        state: dict = {}
        steps = [model.decoder(tokens[:, : i + 1], incremental_state=state)[0] for i in range(tokens.size(1))]
    assert (full - torch.cat(steps, dim=1)).abs().max().item() < 1e-5


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "magneto")
def test_encoder_decoder_incremental_equals_full(overrides):
    torch.manual_seed(0)
    d = dictionary()
    model = build("mt", d, **overrides).eval()
    src = torch.randint(d.nspecial, len(d), (3, 9))
    src[0, :3] = d.pad()  # left padding, as fairseq's translation task batches sources
    tgt = torch.randint(d.nspecial, len(d), (3, 11))
    with torch.no_grad():
        enc = model.encoder(src)
        full = model.decoder(tgt, enc)[0]
        state: dict = {}
        steps = [model.decoder(tgt[:, : i + 1], enc, incremental_state=state)[0] for i in range(tgt.size(1))]
    assert (full - torch.cat(steps, dim=1)).abs().max().item() < 1e-5


def test_reorder_incremental_state_follows_beam_order():
    """After reordering the cache, decoding continues as if the batch had been permuted."""
    torch.manual_seed(0)
    d = dictionary()
    model = build("mt", d).eval()
    src = torch.randint(d.nspecial, len(d), (3, 7))
    tgt = torch.randint(d.nspecial, len(d), (3, 6))
    order = torch.tensor([2, 2, 0])
    with torch.no_grad():
        enc = model.encoder(src)
        state: dict = {}
        for i in range(5):
            model.decoder(tgt[:, : i + 1], enc, incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, order)
        enc_r = model.encoder.reorder_encoder_out(enc, order)
        last = model.decoder(tgt[order, :6], enc_r, incremental_state=state)[0]
        reference = model.decoder(tgt[order], model.encoder(src[order]))[0][:, -1:]
    assert (last - reference).abs().max().item() < 1e-5


def test_left_padded_source_gives_same_output_as_unpadded():
    torch.manual_seed(0)
    d = dictionary()
    model = build("mt", d).eval()
    src = torch.randint(d.nspecial, len(d), (1, 6))
    padded = torch.cat([torch.full((1, 3), d.pad()), src], dim=1)
    tgt = torch.randint(d.nspecial, len(d), (1, 5))
    with torch.no_grad():
        a = model(src, torch.tensor([6]), tgt)[0]
        b = model(padded, torch.tensor([6]), tgt)[0]
    assert (a - b).abs().max().item() < 1e-5
