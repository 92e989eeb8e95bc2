"""``--ts-compile``: each transformer layer compiled in place by ``torch.compile``
(inductor) trains to the same per-update losses as the eager model (float rounding only),
with the same parameter names, so checkpoints are interchangeable. (Parameters are not
compared: Adam turns rounding-level differences of near-zero gradients into steps of ``lr``.)"""

from __future__ import annotations

import functools

import torch
from torch._dynamo.utils import counters

from tests.helpers.model_utils import build, dictionary
from torchscale_fairseq.architecture.layer import _compiled_forward
from torchscale_fairseq.modules.moe.experts import GroupedExperts

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


def test_batch_size_and_right_padding_compile_once():
    """An epoch's last batch is smaller, and right-padded rows are common: neither recompiles the layer
    (the batch dimension is dynamic from the first step; right pads need no attention mask under causal
    attention, the loss ignoring pad targets) nor breaks its graph, and the losses stay the eager ones."""
    torch.set_num_threads(1)
    d = dictionary()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(d.nspecial, len(d), (n, 17), generator=g) for n in (4, 4, 3)]
    batches[1][1, 12:] = d.pad()  # a shorter sentence at the end of a block
    batches[2][0, 9:] = d.pad()
    torch.manual_seed(1)
    eager = build("lm", d, decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=64)
    torch.manual_seed(1)
    compiled = build("lm", d, decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=64, ts_compile=True)

    def losses(model) -> list[float]:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        out = []
        for tokens in batches:
            logits, _ = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                                     ignore_index=d.pad())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            out.append(float(loss))
            if model is compiled and len(out) == 1:
                graphs.append(counters["stats"]["unique_graphs"])
        return out

    graphs: list[int] = []
    expected = losses(eager)
    torch._dynamo.reset()
    counters.clear()
    got = losses(compiled)
    assert graphs[0] >= 1 and counters["stats"]["unique_graphs"] == graphs[0], "a later batch recompiled the layer"
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


def test_moe_layers_compile_without_graph_breaks(monkeypatch):
    """An X-MoE ``ts_lm`` at expert-parallel size 1 whose experts run grouped GEMMs (as on a Hopper GPU
    in bf16; forced here, in bf16, which ``torch._grouped_mm``'s tracing requires) compiles each layer,
    MoE layers included, without a graph break: routing, capacity, balance loss, statistics and dispatch
    keep fixed shapes (issue 26 item 2), through batch-size changes and padding; losses equal eager.
    The ``aot_eager`` backend traces forward and backward as inductor does, without its code generation."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    _compiled_forward.cache_clear()
    torch.set_num_threads(1)
    d = dictionary()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(d.nspecial, len(d), (n, 17), generator=g) for n in (4, 4, 3)]
    batches[1][1, 12:] = d.pad()
    batches[2][0, 9:] = d.pad()
    sizes = dict(decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=64, moe_expert_count=4, moe_freq=1,
                 moe_second_expert_policy="all")

    def grouped(model):
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                module.grouped_mm = True
        return model.bfloat16()

    torch.manual_seed(1)
    eager = grouped(build("lm", d, **sizes))
    torch.manual_seed(1)
    compiled = grouped(build("lm", d, **sizes, ts_compile=True))

    def losses(model) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for tokens in batches:
            logits, extra = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                                     ignore_index=d.pad())
            loss = loss + 0.01 * sum(aux.balance_loss for aux in extra["moe"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            out.append(float(loss))
        return out

    expected = losses(eager)
    torch._dynamo.reset()
    counters.clear()
    try:
        got = losses(compiled)
    finally:
        _compiled_forward.cache_clear()
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert got == expected
