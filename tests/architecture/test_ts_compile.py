"""``--ts-compile``: each transformer layer compiled in place by ``torch.compile``
(inductor) trains to the same per-update losses as the eager model (float rounding only),
with the same parameter names, so checkpoints are interchangeable. (Parameters are not
compared: Adam turns rounding-level differences of near-zero gradients into steps of ``lr``.)"""

from __future__ import annotations

import dataclasses
import enum
import logging
import types

import pytest
import torch
from torch._dynamo.utils import counters

from tests.helpers.model_utils import build, dictionary, fairseq_train_model
from torchscale_fairseq.architecture.compile_report import compile_fallback_report
from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.layer import TransformerLayer, _compiled_forward
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


def _grouped_bf16(model):
    """Experts on grouped GEMMs in bf16, as on a Hopper GPU (no host read of the counts, no graph break)."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.grouped_mm = True
    return model.bfloat16()


def _compiled_run(model, steps) -> dict:
    """dynamo's counters after ``steps`` (callables of the model) from a clean cache."""
    torch._dynamo.reset()
    counters.clear()
    try:
        for step in steps:
            step(model)
    finally:
        _compiled_forward.cache_clear()
    return {"graphs": counters["stats"]["unique_graphs"], "frames": dict(counters["frames"])}


def test_moe_layers_compile_without_graph_breaks(aot_eager_layers):
    """An X-MoE ``ts_lm`` at expert-parallel size 1 whose experts run grouped GEMMs (as on a Hopper GPU
    in bf16; forced here, in bf16, which ``torch._grouped_mm``'s tracing requires) compiles each layer,
    MoE layers included, without a graph break: routing, capacity, balance loss, statistics and dispatch
    keep fixed shapes (issue 26 item 2), through batch-size changes and padding; losses equal eager.
    The ``aot_eager`` backend traces forward and backward as inductor does, without its code generation."""
    torch.set_num_threads(1)
    d = dictionary()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(d.nspecial, len(d), (n, 17), generator=g) for n in (4, 4, 3)]
    batches[1][1, 12:] = d.pad()
    batches[2][0, 9:] = d.pad()
    sizes = dict(decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=64, moe_expert_count=4, moe_freq=1,
                 moe_second_expert_policy="all")

    torch.manual_seed(1)
    eager = _grouped_bf16(build("lm", d, **sizes))
    torch.manual_seed(1)
    compiled = _grouped_bf16(build("lm", d, **sizes, ts_compile=True))

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
    got = losses(compiled)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert got == expected


def test_moe_layers_share_one_graph_at_any_depth(dynamo_only_layers):
    """Regional compilation compiles the MoE layer once, not once per layer: one MoE layer and three
    make as many graphs over the same batches, and each layer's auxiliary output keeps its own tag
    (set outside the graph: a tag read inside it is guarded by value, one recompilation per layer,
    and past dynamo's recompile limit the deeper layers ran eager)."""
    torch.set_num_threads(1)
    d = dictionary()
    tokens = torch.randint(d.nspecial, len(d), (4, 17), generator=torch.Generator().manual_seed(0))
    tags: list[list[str]] = []

    def train(model):
        logits, extra = model(tokens[:, :-1])
        logits.float().sum().backward()
        tags.append([aux.tag for aux in extra["moe"]])

    runs = {}
    for layers in (1, 3):
        model = _grouped_bf16(build("lm", d, decoder_layers=layers, decoder_embed_dim=32, decoder_ffn_embed_dim=64,
                                    moe_expert_count=4, moe_freq=1, ts_compile=True))
        runs[layers] = _compiled_run(model, [train, train])
        assert tags[-1] == [f"dec{i}" for i in range(layers)]
    assert runs[1]["graphs"] >= 1 and runs[3] == runs[1], runs


def test_moe_translation_layers_all_run_compiled(dynamo_only_layers):
    """An MoE translation model's layers are four kinds (dense or MoE, encoder or decoder), each compiled
    for training and for validation, with static and then dynamic lengths: at least dynamo's default
    recompile limit (8) of cache entries of the one compiled function, past which a layer would run eager
    (more before the routing statistics of an unpadded batch stopped specialising a graph to its token count).
    Every frame compiles (``COMPILED_LAYER_ENTRIES``) through training and validation at three batch shapes."""
    torch.set_num_threads(1)
    d = dictionary()
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 11, 13), (3, 15, 9), (5, 7, 17)]  # (sentences, source length, target length)
    batches = [(torch.randint(d.nspecial, len(d), (n, s), generator=g), torch.full((n,), s),
                torch.randint(d.nspecial, len(d), (n, t), generator=g)) for n, s, t in shapes]
    torch.manual_seed(1)
    model = _grouped_bf16(build("mt", d, encoder_layers=1, decoder_layers=1, encoder_embed_dim=32,
                                decoder_embed_dim=32, encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64,
                                moe_expert_count=4, moe_freq=1, ts_compile=True))

    def step(batch):
        def run(model):
            model.train()
            logits, extra = model(*batch)
            logits.float().sum().backward()
            assert [aux.tag for aux in extra["moe"]] == ["enc0", "dec0"]
            model.eval()
            with torch.no_grad():
                model(*batch)
        return run

    run = _compiled_run(model, [step(batch) for batch in batches])
    assert run["frames"]["total"] == run["frames"]["ok"] >= 8, run
    assert not counters["graph_break"], dict(counters["graph_break"])


def _enum_members(obj, path: str) -> list[str]:
    """Paths of the ``Enum`` members in ``obj``: itself, its dataclass fields, list items and dict values."""
    if isinstance(obj, enum.Enum):
        return [path]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [p for f in dataclasses.fields(obj) for p in _enum_members(getattr(obj, f.name), f"{path}.{f.name}")]
    if isinstance(obj, (list, tuple)):
        return [p for i, item in enumerate(obj) for p in _enum_members(item, f"{path}[{i}]")]
    if isinstance(obj, dict):
        return [p for key, value in obj.items() for p in _enum_members(value, f"{path}[{key!r}]")]
    return []


@pytest.mark.parametrize("arch", ["ts_lm_tiny", "ts_transformer_tiny"])
def test_fairseq_train_choices_reach_the_modules_as_strings(lm_data, mt_data, arch):
    """No module of a model built by fairseq-train, with MoE layers and most choice flags set (the others at
    their enum defaults), keeps an enum member among its attributes (what torch 2.11's compile traces wrong)."""
    from tests.helpers.cli_utils import USER_DIR

    data = ([str(lm_data), "--task", "language_modeling", "--tokens-per-sample", "16"] if arch.startswith("ts_lm")
            else [str(mt_data), "--task", "translation"])
    _, model = fairseq_train_model([
        *data, "--user-dir", USER_DIR, "--arch", arch, "--cpu", "--ts-compile", "--activation-fn", "gelu",
        "--backbone", "magneto", "--ts-attention-backend", "math", "--checkpoint-activations", "selective",
        "--moe-expert-count", "4", "--moe-router", "linear", "--moe-second-expert-policy", "all",
        "--moe-balance-scope", "global", "--moe-checkpoint-exchange", "keep", "--moe-compiled-routing", "on",
        "--moe-compiled-experts", "on",
    ])
    found = [p for name, m in model.named_modules() for key, value in vars(m).items() if not key.startswith("_")
             for p in _enum_members(value, f"{name or type(m).__name__}.{key}")]
    assert not found, found


@pytest.mark.parametrize("arch", ["ts_lm_tiny", "ts_transformer_tiny"])
def test_fairseq_train_config_compiles_each_layer_whole(lm_data, mt_data, dynamo_only_layers, arch):
    """A model built from fairseq-train's own typed config, which holds each choice flag as a ``ChoiceEnum``
    member (equal to its string, not a string), has plain strings in its stack config, compiles each layer
    whole and computes what the eager layers compute. torch 2.11 (the GPU node's) traced ``member == "auto"``
    and ``member == "gelu"`` as False: the first led to a dict lookup that made dynamo leave the layer eager
    and compile its parts one by one, the second to ReLU in the compiled FFN."""
    from tests.helpers.cli_utils import USER_DIR

    torch.set_num_threads(1)
    data = ([str(lm_data), "--task", "language_modeling", "--tokens-per-sample", "16"] if arch.startswith("ts_lm")
            else [str(mt_data), "--task", "translation"])
    task, model = fairseq_train_model([*data, "--user-dir", USER_DIR, "--arch", arch, "--cpu", "--ts-compile",
                                        "--activation-fn", "gelu", "--backbone", "magneto", "--dropout", "0.1"])
    stacks = [m for m in model.modules() if isinstance(getattr(m, "cfg", None), StackConfig)]
    assert stacks and not [p for m in stacks for p in _enum_members(m.cfg, type(m).__name__)]
    d = task.target_dictionary
    tokens = torch.randint(d.nspecial, len(d), (3, 9), generator=torch.Generator().manual_seed(0))
    inputs = (tokens,) if arch.startswith("ts_lm") else (tokens, torch.full((3,), 9), tokens)
    model.train()
    counters.clear()
    model(*inputs)[0].float().sum().backward()
    assert compile_fallback_report() is None, compile_fallback_report()
    assert counters["frames"]["ok"] >= 1, dict(counters["frames"])
    if arch.startswith("ts_lm"):
        assert counters["frames"]["ok"] == 1  # the decoder's layers: one frame, whole
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    model.eval()
    with torch.no_grad():
        compiled = model(*inputs)[0]
        for layer in layers:
            layer.compiled = False
        eager = model(*inputs)[0]
    torch.testing.assert_close(compiled, eager)  # 2.11 traced `activation == "gelu"` as False: ReLU, compiled


def test_compile_fallback_report_names_breaks_and_functions_left_eager():
    """The trainer's line under ``--ts-compile``: ``None`` where everything compiled whole; the count and the
    reason of a graph break, and of a function dynamo gave up on (as 2.11 did on the layer)."""
    torch._dynamo.reset()
    counters.clear()
    assert compile_fallback_report() is None

    @torch.compile(backend="eager")
    def halves(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    @torch.compile(backend="eager")
    def left_eager(x):
        torch._dynamo.skip_frame()
        return x + 1

    try:
        torch.testing.assert_close(halves(torch.ones(2)), torch.full((2,), 4.0))
        report = compile_fallback_report()
        assert report is not None and "0 function(s) eagerly and broke 1 graph(s)" in report, report
        assert "graph_break" in report, report
        torch.testing.assert_close(left_eager(torch.ones(2)), torch.full((2,), 2.0))
        report = compile_fallback_report()
        assert report is not None and "ran 1 function(s) eagerly" in report, report
    finally:
        torch._dynamo.reset()
        counters.clear()


def test_fairseq_train_says_the_layers_compiled_whole(lm_data, tmp_path):
    """``fairseq-train --ts-compile`` says once, after its first update, that every compiled function ran
    whole (otherwise that line is the warning of :func:`compile_fallback_report`)."""
    from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, run, tool

    out = run([tool("fairseq-train"), str(lm_data), "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update", "2",
               "--no-save", *LM_TRAIN, "--ts-compile", "--decoder-layers", "1", "--save-dir", str(tmp_path)])
    log = out.stdout + out.stderr
    assert log.count("--ts-compile: the first update ran every compiled function whole") == 1, log[-3000:]
    assert "torch.compile ran" not in log
    assert "new graph(s)" not in log  # every update after the first ran what the first compiled


def test_fairseq_train_says_when_a_later_update_compiles_again(lm_data, tmp_path):
    """A later update that compiles again (here: sentences of other lengths than the first batch's, under
    ``--sample-break-mode eos``, recompile the layer with a dynamic length) is named with the number of
    graphs compiled; a run of fixed-length blocks names none (the test above)."""
    import re

    from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, run, tool

    args = [*LM_TRAIN, "--sample-break-mode", "eos", "--batch-size", "4"]  # later flags win
    out = run([tool("fairseq-train"), str(lm_data), "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update", "4",
               "--no-save", *args, "--ts-compile", "--decoder-layers", "1", "--save-dir", str(tmp_path)])
    log = out.stdout + out.stderr
    assert log.count("--ts-compile: the first update ran every compiled function whole") == 1, log[-3000:]
    again = re.findall(r"--ts-compile: update (\d+) compiled (\d+) new graph\(s\)", log)
    assert again and all(int(update) > 1 and int(count) >= 1 for update, count in again), log[-3000:]
    assert "torch.compile ran" not in log


def _fallback_lines(monkeypatch, caplog, parallel) -> list[tuple[int, str]]:
    """The trainer's fallback report, made twice with the same counts, as ``parallel``'s rank logs it."""
    from torchscale_fairseq.integration import trainer as trainer_module

    stub = types.SimpleNamespace(parallel=parallel, _graphs_unreported=0, _compile_report_pending=False,
                                 _fallbacks_reported=None, get_num_updates=lambda: 1)
    monkeypatch.setattr(trainer_module, "compile_fallback_report", lambda: "torch.compile ran 1 function(s) eagerly")
    with caplog.at_level(logging.INFO, logger=trainer_module.logger.name):
        trainer_module.TsTrainer._report_compilations(stub, 0)
        trainer_module.TsTrainer._report_compilations(stub, 0)  # the same counts: not again
    return [(r.levelno, r.getMessage()) for r in caplog.records]


@pytest.mark.parametrize("rank,level,stage", [
    (0, logging.WARNING, 0),  # data rank 0, tensor rank 0 of stage 0
    (1, logging.INFO, 0),  # tensor rank 1
    (2, logging.INFO, 0),  # data rank 1
    (4, logging.WARNING, 1),  # data rank 0, tensor rank 0 of stage 1
    (7, logging.INFO, 1),
])
def test_the_fallback_warning_comes_once_per_pipeline_stage(monkeypatch, caplog, rank, level, stage):
    """8 ranks, tensor 2 x data 2 x pipeline 2 (Megatron's order: tensor ranks adjacent, then data, then stage):
    the first rank of each stage warns, naming its stage; the replicas, which compile alike, log it at INFO
    (fairseq keeps INFO off the console of every rank but the first)."""
    from torchscale_fairseq.model_parallel.parallel_context import ParallelContext

    base, tensor, data = rank - rank % 4, rank % 2, rank % 4 // 2
    parallel = ParallelContext(8, rank, tensor_ranks=(base + 2 * data, base + 2 * data + 1),
                               data_ranks=(base + tensor, base + 2 + tensor), pipeline_ranks=(rank % 4, rank % 4 + 4),
                               embedding_ranks=(rank % 4, rank % 4 + 4))
    assert _fallback_lines(monkeypatch, caplog, parallel) == [
        (level, f"--ts-compile (pipeline stage {stage}): torch.compile ran 1 function(s) eagerly")]


def test_the_fallback_warning_of_one_process_names_no_stage(monkeypatch, caplog):
    from torchscale_fairseq.model_parallel.parallel_context import ParallelContext

    assert _fallback_lines(monkeypatch, caplog, ParallelContext.single_process()) == [
        (logging.WARNING, "--ts-compile: torch.compile ran 1 function(s) eagerly")]
