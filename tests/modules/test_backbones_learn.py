"""Every backbone x model learns in-process: a few Adam steps memorise a fixed batch
(the CLI runs in test_cli_train.py cover every model and backbone once through fairseq-train)."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.model_utils import build, dictionary


def logits(kind: str, model, tokens: torch.Tensor) -> torch.Tensor:
    lengths = torch.full((tokens.size(0),), tokens.size(1))
    if kind == "mt":
        return model(tokens, lengths, tokens.roll(1, dims=1))[0]
    return model(tokens, lengths)[0] if kind == "mlm" else model(tokens)[0]


@pytest.mark.parametrize("backbone", ["magneto", "deepnorm", "preln", "postln"])
@pytest.mark.parametrize("kind", ["lm", "mt", "mlm"])
def test_fixed_batch_is_memorised(kind: str, backbone: str) -> None:
    torch.manual_seed(0)
    d = dictionary()
    model = build(kind, d, backbone=backbone)
    tokens = torch.randint(d.nspecial, len(d), (4, 12))
    target = torch.randint(d.nspecial, len(d), (4, 12))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        out = logits(kind, model, tokens)
        loss = F.cross_entropy(out.reshape(-1, out.size(-1)).float(), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
