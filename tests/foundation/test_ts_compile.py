"""``--ts-compile``: each transformer layer compiled in place by ``torch.compile``
(inductor) trains to the same per-update losses as the eager model (float rounding only),
with the same parameter names, so checkpoints are interchangeable. (Parameters are not
compared: Adam turns rounding-level differences of near-zero gradients into steps of ``lr``.)"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from tests.model_utils import build, dictionary

UPDATES = 3


def train_losses(model, batches: list[torch.Tensor]) -> list[float]:
    """Per-update loss of Adam on next-token prediction over ``batches``."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for tokens in batches:
        logits, _ = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def test_compiled_layers_train_like_eager():
    torch.set_num_threads(1)
    d = dictionary()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(d.nspecial, len(d), (4, 17), generator=g) for _ in range(UPDATES)]
    torch.manual_seed(1)
    eager = build("lm", d, decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=64)
    torch.manual_seed(1)
    compiled = build("lm", d, decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=64, ts_compile=True)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints unchanged
    torch._dynamo.reset()
    counters.clear()
    expected = train_losses(eager, batches)
    assert counters["frames"]["ok"] == 0
    got = train_losses(compiled, batches)
    assert counters["stats"]["unique_graphs"] >= 1  # the layers did run through dynamo
    assert expected[-1] < expected[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
