"""``--ts-cuda-graphs`` on the device, against the same model without graphs: losses and accumulated
gradients of real captures (``torch.cuda.make_graphed_callables``, eager and ``--ts-compile`` layers,
parameters updated between replays, micro-batches accumulated), and dropout drawing new masks at every
replay. ``fairseq-train`` with the flag: ``test_cuda_fast_paths.py``. The CPU suite checks the dispatch
and the static buffers with a stand-in capture (``tests/architecture/test_cuda_graphs.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.model_utils import build, dictionary
from torchscale_fairseq.architecture.cuda_graphs import GraphedLayers, make_graphed_layers

pytestmark = pytest.mark.gpu

DIMS = dict(decoder_layers=3, decoder_embed_dim=64, decoder_ffn_embed_dim=256)


def lm(seed: int, **overrides):
    torch.manual_seed(seed)
    return build("lm", dictionary(), **DIMS, **overrides).cuda().train()


def counted(model) -> list:
    """The model's graphs captured by the real capture, each replay of a layer's forward counted."""
    replays: list = []

    def capture(steps, samples):
        return tuple((lambda x, step=step: replays.append(1) or step(x)) for step in make_graphed_layers(steps, samples))
    model.decoder.cuda_graphs = GraphedLayers(capture, model.decoder.cfg.compile_layers)
    return replays


def train(model, updates: list[list[torch.Tensor]]) -> tuple[list[float], list[torch.Tensor]]:
    """Per-update summed losses of Adam over micro-batches that accumulate, and the first update's gradients."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, first_grads = [], []
    for micro_batches in updates:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens in micro_batches:
            logits, _ = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            total += float(loss)
        if not first_grads:
            first_grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        losses.append(total)
    return losses, first_grads


@pytest.mark.parametrize("compiled", [False, True])
def test_graphed_layers_on_cuda_train_like_the_layers(compiled):
    d = dictionary()
    g = torch.Generator(device="cuda").manual_seed(0)
    data = [[torch.randint(d.nspecial, len(d), (8, 65), device="cuda", generator=g) for _ in range(2)]
            for _ in range(4)]
    plain_losses, plain_grads = train(lm(1, ts_compile=compiled), data)
    model = lm(1, ts_compile=compiled, ts_cuda_graphs=True)
    replays = counted(model)
    losses, grads = train(model, data)
    assert len(replays) == 4 * 2 * DIMS["decoder_layers"]  # every micro-batch, every layer
    assert plain_losses[-1] < plain_losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-4, atol=0)
    for got, want in zip(grads, plain_grads):
        assert float((got - want).norm()) <= 1e-4 * float(want.norm()) + 1e-7


def test_graphed_dropout_draws_new_masks_at_every_replay():
    d = dictionary()
    model = lm(2, dropout=0.1, ts_cuda_graphs=True)
    replays = counted(model)
    tokens = torch.randint(d.nspecial, len(d), (8, 64), device="cuda")
    first, _ = model(tokens)
    second, _ = model(tokens)
    third, _ = model(tokens)
    assert len(replays) == 3 * DIMS["decoder_layers"]
    assert not torch.equal(second, third) and not torch.equal(first, second)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens)[0], model(tokens)[0])  # no dropout, no graphs: deterministic
