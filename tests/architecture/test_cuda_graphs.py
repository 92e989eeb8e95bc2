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
from tests.helpers.model_utils import build, dictionary, train_lm
from torchscale_fairseq.architecture.cuda_graphs import GraphedLayers, LayerStep, make_graphed_layers
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.host_overhead import check_cuda_graphs
from torchscale_fairseq.modules.moe.aux_loss import aux_loss_scales, set_aux_loss_scale
from torchscale_fairseq.modules.moe.layer import MoELayer

DIMS = dict(decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=64, dropout=0.0)


class StaticBufferCapture:
    """``make_graphed_callables``' input, output and gradient buffers on the CPU (module docstring),
    after a warm-up pass of each layer on its samples, as the capture runs."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def __call__(self, steps, samples):
        self.captures += 1
        self.samples_need_grad = [inputs[0].requires_grad for inputs in samples]
        for step, inputs in zip(steps, samples):
            step(*inputs)
        return tuple(self._replayed(step, inputs) for step, inputs in zip(steps, samples))

    def _replayed(self, step, static_inputs):
        params = tuple(step.parameters())
        static: dict = {}
        capture = self

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                capture.replays += 1
                for buffer, arg in zip(static_inputs, args):
                    buffer.detach().copy_(arg)
                with torch.enable_grad():
                    live = [buffer.detach().requires_grad_(buffer.requires_grad) for buffer in static_inputs]
                    out = step(*live)
                outs = out if isinstance(out, tuple) else (out,)
                static["inputs"], static["outputs"] = live, outs
                buffers = static.setdefault("outputs_static", [torch.empty_like(o) for o in outs])
                for buffer, o in zip(buffers, outs):
                    buffer.copy_(o.detach())
                replayed = tuple(buffer.detach() for buffer in buffers)
                return replayed if isinstance(out, tuple) else replayed[0]

            @staticmethod
            def backward(ctx, *grads):
                inputs = [t for t in static["inputs"] if t.requires_grad]
                pairs = [(o, g) for o, g in zip(static["outputs"], grads) if o.requires_grad]
                got = torch.autograd.grad([o for o, _ in pairs], (*inputs, *params), [g for _, g in pairs],
                                          allow_unused=True)
                buffers = static.setdefault("grads", [torch.zeros_like(t) for t in (*inputs, *params)])
                for buffer, g in zip(buffers, got):
                    buffer.copy_(g if g is not None else torch.zeros_like(buffer))
                out = iter(buffer.detach() for buffer in buffers)
                return (*(next(out) if t.requires_grad else None for t in static["inputs"]), *out)

        return lambda *args: Replay.apply(*args, *params)


def graphed_lm(**overrides):
    model = build("lm", dictionary(), **DIMS, ts_cuda_graphs=True, **overrides)
    capture = StaticBufferCapture()
    model.decoder.cuda_graphs = GraphedLayers(capture)
    return model, capture


def batches(shape: tuple[int, int], updates: int, micro: int) -> list[list[torch.Tensor]]:
    d = dictionary()
    g = torch.Generator().manual_seed(0)
    return [[torch.randint(d.nspecial, len(d), shape, generator=g) for _ in range(micro)] for _ in range(updates)]


# layer 2 of 2 an MoE layer (the fused dispatch; an aux-loss-free router bias, whose expert loads the
# capture's warm-up must not count); a deterministic second expert, as the warm-up draws random numbers
MOE = dict(moe_expert_count=4, moe_freq=2, moe_second_expert_policy="all", moe_router_bias_update_rate=0.05)


@pytest.mark.parametrize("micro, frozen_embedding, moe", [(1, False, False), (3, False, False), (1, True, False),
                                                          (1, False, True), (3, False, True)])
def test_graphed_layers_train_like_the_layers(micro, frozen_embedding, moe):
    """Losses, parameters and buffers equal the model without graphs, micro-batches accumulated
    (``--update-freq``): a static gradient autograd kept as ``.grad`` would otherwise be overwritten by the
    next replay. With the embedding frozen the first layer's input needs no gradient, the others' still do.
    An MoE layer's balance and z-loss gradients reach its router through the graph, its figures are
    those of the layer run as it is, and its expert biases move as without graphs."""
    torch.set_num_threads(1)
    data = batches((4, 17), 3, micro)
    overrides = MOE if moe else {}
    models = []
    for graphs in (False, True):
        torch.manual_seed(1)
        model, capture = graphed_lm(**overrides) if graphs else (build("lm", dictionary(), **DIMS, **overrides), None)
        model.decoder.embed.embed_tokens.weight.requires_grad_(not frozen_embedding)
        models.append(model)
    plain, graphed = models
    assert list(graphed.state_dict()) == list(plain.state_dict())  # checkpoints unchanged
    expected, expected_figures, _ = train_lm(plain, data, lr=1e-2)
    got, figures, _ = train_lm(graphed, data, lr=1e-2)
    assert capture.captures == 1 and capture.replays == 3 * micro * 2  # every micro-batch, both layers
    assert capture.samples_need_grad == [not frozen_embedding, True]
    assert expected[-1] < expected[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-6, atol=0)
    for (name, p), q in zip(graphed.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert len(figures) == len(expected_figures) == 3 * micro
    for logged, want in zip(figures, expected_figures):
        assert logged.keys() == want.keys() and logged == pytest.approx(want, rel=1e-5, abs=1e-7)
    if moe:
        (layer,) = [m for m in graphed.modules() if isinstance(m, MoELayer)]
        assert "moe_cv_dec1" in figures[0] and figures[0]["moe_gate_loss"] > 0 and layer.expert_bias.abs().sum() > 0


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


def test_moe_layers_without_auxiliary_loss_gradients_run_as_they_are():
    """A training forward of an MoE model outside the trainer's step (no
    :class:`~torchscale_fairseq.modules.moe.aux_loss.AuxLossScale` set) runs the layers; the graphs
    replay once the scales are set."""
    torch.set_num_threads(1)
    d = dictionary()
    torch.manual_seed(1)
    model, capture = graphed_lm(**MOE)
    tokens = torch.randint(d.nspecial, len(d), (4, 16), generator=torch.Generator().manual_seed(0))
    _, extra = model(tokens)
    assert (capture.captures, capture.replays) == (0, 0) and len(extra["moe"]) == 1
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    set_aux_loss_scale(moe_layers, aux_loss_scales([64], [False], 0.1, 0.01, 1.0, torch.device("cpu"))[0])
    _, extra = model(tokens)
    assert (capture.captures, capture.replays) == (1, 2) and [a.tag for a in extra["moe"]] == ["dec1"]


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
    steps, samples = (LayerStep(graphed_lm()[0].decoder.chunk_layers(0)[0]),), ((torch.zeros(2, 3, 32),),)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", without_the_argument)
    assert make_graphed_layers(steps, samples) == steps
    assert seen["graph"].func is graph and seen["graph"].keywords == {"capture_error_mode": "thread_local"}
    assert torch.cuda.graph is graph
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", with_the_argument)
    make_graphed_layers(steps, samples)
    assert seen["mode"] == "thread_local" and torch.cuda.graph is graph


def test_moe_layers_whose_experts_read_counts_on_the_host_are_refused(monkeypatch):
    """An MoE layer whose experts run one GEMM per expert (here: the CPU, fp32) reads its row counts on
    the host, which a capture cannot hold: one line before anything is captured."""
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", lambda *a, **k: pytest.fail("captured"))
    model, _ = graphed_lm(**MOE)
    steps = tuple(LayerStep(layer) for layer in model.decoder.chunk_layers(0))
    x, scale = torch.zeros(2, 3, 32), torch.ones(())
    with pytest.raises(TsConfigError) as e:
        make_graphed_layers(steps, ((x,), (x, scale, scale)))
    assert str(e.value).startswith("--ts-cuda-graphs captures MoE layers whose experts run grouped GEMMs")
    assert "layer 'dec1' runs one GEMM per expert on cpu in float32" in str(e.value) and "\n" not in str(e.value)


def test_the_refusals_name_what_is_not_captured(lm_data, tmp_path):
    proc = run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--save-dir", tmp_path, *LM_TRAIN,
                "--arch", "ts_lm_tiny", "--max-update", "1", "--no-save", "--ts-cuda-graphs"], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert last_error_line(proc).endswith("--ts-cuda-graphs needs a CUDA device and this run is on the CPU: drop the flag")

    def cfg(common=None, task=None, **model):
        return OmegaConf.create({"common": {"amp": False, "bf16": False, **(common or {})}, "task": task or {},
                                 "model": model})

    hopper, ampere = (9, 0), (8, 0)
    check_cuda_graphs(cfg(), 1, hopper)
    check_cuda_graphs(cfg(fp8="none"), 1, ampere)
    check_cuda_graphs(cfg(common={"bf16": True}, moe_expert_count=4), 1, hopper)
    refused = [
        (lambda: check_cuda_graphs(cfg(common={"amp": True}), 1, hopper), "cannot replay --amp's autocast"),
        (lambda: check_cuda_graphs(cfg(), 2, hopper), "runs on one GPU for now (this run has 2 ranks)"),
        (lambda: check_cuda_graphs(cfg(task={"document_masking": True}), 1, hopper),
         "drop --document-masking or the flag"),
        (lambda: check_cuda_graphs(cfg(fp8="rowwise"), 1, hopper), "--ts-cuda-graphs and --fp8 have not been tested"),
        (lambda: check_cuda_graphs(cfg(moe_expert_count=4), 1, hopper),
         "captures MoE layers whose experts run grouped GEMMs, in bf16: add --bf16 or drop the flag"),
        (lambda: check_cuda_graphs(cfg(common={"bf16": True}, moe_expert_count=4), 1, ampere),
         "which need a GPU of compute capability 9.0 or more (this one: 8.0): drop the flag"),
        (lambda: graphed_lm(checkpoint_activations="full"), "cannot capture --checkpoint-activations' recomputation"),
        (lambda: graphed_lm(checkpoint_activations="selective"), "cannot capture --checkpoint-activations'"),
        (lambda: graphed_lm(rel_pos_buckets=32), "use --xpos or --rel-pos-buckets 0"),
    ]
    for refusal, message in refused:
        with pytest.raises(TsConfigError, match="^--ts-cuda-graphs ") as e:
            refusal()
        assert message in str(e.value) and "\n" not in str(e.value)
