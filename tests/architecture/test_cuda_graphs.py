"""``--ts-cuda-graphs`` on the CPU: the decoder's dispatch to its captured layers and their static
buffers, through a stand-in for ``torch.cuda.make_graphed_callables`` that keeps its semantics but
runs the layer on every call (the capture itself needs a GPU: ``tests/gpu/test_cuda_fast_paths.py``).
The stand-in copies each input into the static sample tensor, writes the output and, in backward,
the gradients into static tensors that every call overwrites, and hands out detached aliases of
them (none for a sample that needs no gradient), as a replay does; autograd may then keep a static
gradient as a parameter's ``.grad``. Reference: the same model without graphs (losses, updates and
accumulated gradients)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, last_error_line, run, tool
from tests.helpers.model_utils import build, dictionary
from torchscale_fairseq.architecture.cuda_graphs import GraphedLayers, make_graphed_layers
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.host_overhead import check_cuda_graphs

DIMS = dict(decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=64, dropout=0.0)


class StaticBufferCapture:
    """``make_graphed_callables``' input, output and gradient buffers on the CPU (module docstring)."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def __call__(self, steps, samples):
        self.captures += 1
        self.samples_need_grad = [static_input.requires_grad for (static_input,) in samples]
        return tuple(self._replayed(step, static_input) for step, (static_input,) in zip(steps, samples))

    def _replayed(self, step, static_input):
        params = tuple(step.parameters())
        static: dict = {}
        capture = self

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, *unused_params):
                capture.replays += 1
                static_input.detach().copy_(x)
                with torch.enable_grad():
                    inp = static_input.detach().requires_grad_(static_input.requires_grad)
                    out = step(inp)
                static["input"], static["output"] = inp, out
                static.setdefault("y", torch.empty_like(out)).copy_(out.detach())
                return static["y"].detach()

            @staticmethod
            def backward(ctx, grad):
                wanted = ((static["input"],) if static_input.requires_grad else ()) + params
                grads = torch.autograd.grad(static["output"], wanted, grad, allow_unused=True)
                buffers = static.setdefault("grads", [torch.zeros_like(t) for t in wanted])
                for buffer, g in zip(buffers, grads):
                    buffer.copy_(g if g is not None else torch.zeros_like(buffer))
                out = tuple(b.detach() for b in buffers)
                return out if static_input.requires_grad else (None, *out)

        return lambda x: Replay.apply(x, *params)


def graphed_lm(**overrides):
    model = build("lm", dictionary(), **DIMS, ts_cuda_graphs=True, **overrides)
    capture = StaticBufferCapture()
    model.decoder.cuda_graphs = GraphedLayers(capture)
    return model, capture


def train(model, updates: list[list[torch.Tensor]]) -> list[float]:
    """Adam over ``updates``, each a list of micro-batches whose gradients accumulate (``--update-freq``)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for micro_batches in updates:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens in micro_batches:
            logits, _ = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            total += float(loss)
        opt.step()
        losses.append(total)
    return losses


def batches(shape: tuple[int, int], updates: int, micro: int) -> list[list[torch.Tensor]]:
    d = dictionary()
    g = torch.Generator().manual_seed(0)
    return [[torch.randint(d.nspecial, len(d), shape, generator=g) for _ in range(micro)] for _ in range(updates)]


@pytest.mark.parametrize("micro, frozen_embedding", [(1, False), (3, False), (1, True)])
def test_graphed_layers_train_like_the_layers(micro, frozen_embedding):
    """Losses and parameters equal the model without graphs, micro-batches accumulated (``--update-freq``):
    a static gradient autograd kept as ``.grad`` would otherwise be overwritten by the next replay. With
    the embedding frozen the first layer's input needs no gradient, the others' still do."""
    torch.set_num_threads(1)
    data = batches((4, 17), 3, micro)
    models = []
    for graphs in (False, True):
        torch.manual_seed(1)
        model, capture = graphed_lm() if graphs else (build("lm", dictionary(), **DIMS), None)
        model.decoder.embed.embed_tokens.weight.requires_grad_(not frozen_embedding)
        models.append(model)
    plain, graphed = models
    assert list(graphed.state_dict()) == list(plain.state_dict())  # checkpoints unchanged
    expected = train(plain, data)
    got = train(graphed, data)
    assert capture.captures == 1 and capture.replays == 3 * micro * 2  # every micro-batch, both layers
    assert capture.samples_need_grad == [not frozen_embedding, True]
    assert expected[-1] < expected[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-6, atol=0)
    for (name, p), q in zip(graphed.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_what_does_not_fit_the_graphs_runs_the_layers(caplog):
    """Evaluation, no-grad passes, another shape (one log line) and a batch that needs a padding mask run
    the layers; the captured shape replays again after them. A copy of the model (``--ema``) is uncaptured."""
    torch.set_num_threads(1)
    d = dictionary()
    torch.manual_seed(1)
    model, capture = graphed_lm()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(d.nspecial, len(d), (4, 16), generator=g)
    model(tokens)
    assert (capture.captures, capture.replays) == (1, 2)
    with torch.no_grad():
        model(tokens)
    model.eval()
    model(tokens)
    model.train()
    with caplog.at_level(logging.INFO, logger="torchscale_fairseq.architecture.cuda_graphs"):
        model(tokens[:3])
        model(tokens[:2])
    assert [r.getMessage() for r in caplog.records] == [
        "--ts-cuda-graphs: a batch of shape (3, 16, 32) ran without the graphs (captured at (4, 16, 32))"]
    left_padded = tokens.clone()
    left_padded[0, :3] = d.pad()
    model(left_padded)
    assert (capture.captures, capture.replays) == (1, 2)
    model(tokens)
    assert (capture.captures, capture.replays) == (1, 4)
    ema = copy.deepcopy(model)
    assert ema.decoder.cuda_graphs.shape is None and ema.decoder.cuda_graphs.steps == ()


def test_graphs_are_for_the_layers_they_captured():
    """Other layers (another chunk of a stack) of the captured shape run as they are."""
    torch.set_num_threads(1)
    model, capture = graphed_lm()
    graphs, layers = model.decoder.cuda_graphs, list(model.decoder.chunk_layers(0))
    x = torch.randn(2, 5, 32)
    assert graphs(layers, x) is not None and capture.replays == 2
    assert graphs(layers[:1], x) is None and graphs(layers[::-1], x) is None and capture.replays == 2


def test_the_capture_runs_in_thread_local_error_mode(monkeypatch):
    """fairseq's loader threads pin memory during the capture: ``torch.cuda.graph`` gets the
    ``thread_local`` mode, through ``make_graphed_callables``' argument where it has one."""
    seen = {}

    def without_the_argument(steps, samples, allow_unused_input=False):
        seen["graph"] = torch.cuda.graph
        return steps

    def with_the_argument(steps, samples, allow_unused_input=False, capture_error_mode="global"):
        seen["mode"] = capture_error_mode
        return steps

    graph = torch.cuda.graph
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", without_the_argument)
    assert make_graphed_layers(("a",), ((None,),)) == ("a",)
    assert seen["graph"].func is graph and seen["graph"].keywords == {"capture_error_mode": "thread_local"}
    assert torch.cuda.graph is graph
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", with_the_argument)
    make_graphed_layers(("a",), ((None,),))
    assert seen["mode"] == "thread_local" and torch.cuda.graph is graph


def test_the_refusals_name_what_is_not_captured(lm_data, tmp_path):
    proc = run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--save-dir", tmp_path, *LM_TRAIN,
                "--arch", "ts_lm_tiny", "--max-update", "1", "--no-save", "--ts-cuda-graphs"], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert last_error_line(proc).endswith("--ts-cuda-graphs needs a CUDA device and this run is on the CPU: drop the flag")

    def cfg(common=None, task=None, **model):
        return OmegaConf.create({"common": {"amp": False, **(common or {})}, "task": task or {}, "model": model})

    check_cuda_graphs(cfg(), 1, cuda=True)
    check_cuda_graphs(cfg(fp8="none"), 1, cuda=True)
    refused = [
        (lambda: check_cuda_graphs(cfg(common={"amp": True}), 1, cuda=True), "cannot replay --amp's autocast"),
        (lambda: check_cuda_graphs(cfg(), 2, cuda=True), "runs on one GPU for now (this run has 2 ranks)"),
        (lambda: check_cuda_graphs(cfg(task={"document_masking": True}), 1, cuda=True),
         "drop --document-masking or the flag"),
        (lambda: check_cuda_graphs(cfg(fp8="rowwise"), 1, cuda=True), "--ts-cuda-graphs and --fp8 have not been tested"),
        (lambda: graphed_lm(moe_expert_count=4), "does not capture MoE layers"),
        (lambda: graphed_lm(checkpoint_activations="full"), "cannot capture --checkpoint-activations' recomputation"),
        (lambda: graphed_lm(checkpoint_activations="selective"), "cannot capture --checkpoint-activations'"),
        (lambda: graphed_lm(rel_pos_buckets=32), "use --xpos or --rel-pos-buckets 0"),
    ]
    for refusal, message in refused:
        with pytest.raises(TsConfigError, match="^--ts-cuda-graphs ") as e:
            refusal()
        assert message in str(e.value) and "\n" not in str(e.value)
