"""``benchmarks/step_overhead.py``: its aten-op and host-sync counters against counts worked out
by hand, its model of which tensors a CUDA run holds on the device against
``torch.optim.Adam``'s host step counter, and each of its three training steps actually
training (a step that silently does nothing fails)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import step_overhead as so  # noqa: E402

TINY = "--decoder-layers 1 --decoder-embed-dim 32 --decoder-attention-heads 2 --decoder-ffn-embed-dim 64 --dropout 0"
THIS_FILE = "tests/benchmarks/test_step_overhead.py"


def counted(fn, *device_tensors: torch.Tensor) -> so.SyncCounter:
    """The syncs of ``fn()`` with ``device_tensors`` (and what is computed from them) on the device."""
    device = so.DeviceTensors()
    device.mark(device_tensors)
    with so.SyncCounter(device) as syncs:
        fn()
    return syncs


def kinds(syncs: so.SyncCounter) -> dict:
    out: dict = {}
    for (what, _), n in syncs.sites.items():
        out[what] = out.get(what, 0) + n
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
def test_item_k_times_and_bool_once_are_k_plus_1_syncs_at_their_lines(k):
    x = torch.arange(4.0)

    def fn():
        for _ in range(k):
            (x * 2).sum().item()
        if x.any():
            pass

    syncs = counted(fn, x)
    assert syncs.total == k + 1
    expected = {"torch.Tensor.__bool__": 1}
    if k:
        expected["torch.Tensor.item"] = k
    assert kinds(syncs) == expected
    assert all(site.startswith(THIS_FILE) and "(fn) <- " + THIS_FILE in site for _, site in syncs.sites)
    assert len(syncs.sites) == (2 if k else 1)  # one line for the k reads, one for the bool


def test_the_same_calls_on_host_tensors_are_no_syncs():
    x = torch.arange(4.0)
    syncs = counted(lambda: ((x * 2).sum().item(), bool(x.any()), x.tolist(), x[x > 1]))
    assert syncs.total == 0


SYNCS = [  # (what, expected syncs) on x = [0, 1, 2, 3], a device tensor
    (lambda x: float(x.sum()), 1),
    (lambda x: int(x[0]), 1),
    (lambda x: [10, 11, 12, 13][x.long()[1]], 1),  # __index__
    (lambda x: f"{x.sum()}", 1),
    (lambda x: 2.0 in x, 1),
    (lambda x: torch.equal(x, x + 0), 1),
    (lambda x: torch.allclose(x, x + 0), 1),
    (lambda x: torch.arange(x.long()[2]), 1),  # a tensor read as a number by an op
    (lambda x: x.tolist(), 1),
    (lambda x: x.cpu(), 1),
    (lambda x: x.numpy(), 1),
    (lambda x: x.to("cpu"), 1),
    (lambda x: torch.zeros(4).copy_(x), 1),  # into a host tensor
    (lambda x: x[x > 1], 1),
    # a mask assigning a number: index_put_ (a sync) before torch 2.15, masked_fill_ (none) from it
    (lambda x: x.clone().__setitem__(x > 1, 0.0), 0 if torch.__version__ >= "2.15" else 1),
    (lambda x: torch.nonzero(x), 1),
    (lambda x: torch.where(x > 1), 1),
    (lambda x: x.masked_select(x > 1), 1),
    (lambda x: torch.unique(x), 1),
    (lambda x: x.long().bincount(), 1),
    (lambda x: x.repeat_interleave(x.long()), 1),
    (lambda x: (x.sum().item(), x.tolist(), x[x > 0]), 3),
    # no sync: values stay on the device, sizes are known on the host
    (lambda x: x.repeat_interleave(x.long(), output_size=6), 0),
    (lambda x: x.repeat_interleave(2), 0),
    (lambda x: x.masked_fill(x > 1, 0.0), 0),
    (lambda x: torch.where(x > 1, x, 0.0), 0),
    (lambda x: x[torch.tensor([0, 2])], 0),
    (lambda x: torch.zeros(4, device=x.device).copy_(x), 0),  # device to device
    (lambda x: x.view(x.size(0), -1).sum() * x.numel(), 0),
]


@pytest.mark.parametrize("fn,expected", SYNCS, ids=[f"case{i}" for i in range(len(SYNCS))])
def test_each_kind_of_sync(fn, expected):
    x = torch.arange(4.0)
    assert counted(lambda: fn(x), x).total == expected


def test_op_counter_counts_each_dispatch_once():
    a, b = torch.randn(3, 4), torch.randn(4, 5)

    def fn():
        y = torch.mm(a, b).relu()  # mm, relu
        for _ in range(3):
            y = y * 2 + 1  # mul, add
        y.view(-1).add_(1)  # view, add_
        return y.data.sum()  # sum; .data is a shallow copy, no op (a mode sees an aten.detach, not counted)

    with so.OpCounter() as ops:
        fn()
    assert ops.total == 2 + 3 * 2 + 2 + 1
    assert ops.counts == {"aten.mm.default": 1, "aten.relu.default": 1, "aten.mul.Tensor": 3, "aten.add.Tensor": 3,
                          "aten.view.default": 1, "aten.add_.Tensor": 1, "aten.sum.default": 1}


def test_adam_state_is_on_the_device_its_step_count_is_not():
    """torch.optim.Adam keeps its step count on the host (it reads it, ``.item()``, per
    parameter): no sync on a GPU, none counted; its moments follow the parameters."""
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    adam = torch.optim.Adam(params, lr=0.1)

    def step():
        sum((p * p).sum() for p in params).backward()
        adam.step()
        adam.zero_grad()

    device = so.DeviceTensors()
    device.mark(params)
    with device:  # the first step builds the state
        step()
    state = adam.state[params[0]]
    assert device.holds(state["exp_avg"]) and device.holds(state["exp_avg_sq"]) and not device.holds(state["step"])
    with so.OpCounter() as ops, so.SyncCounter(device) as syncs:
        step()
    assert ops.counts["aten._local_scalar_dense.default"] == len(params) and syncs.total == 0


@pytest.fixture(scope="module")
def runs():
    return so.build_runs(f"--arch ts_lm {TINY} --backbone magneto",
                         f"--arch transformer_lm {TINY} --decoder-input-dim 32 --decoder-output-dim 32",
                         vocab=40, sample_shape=(4, 16))


def loss_of(model: torch.nn.Module, sample: dict) -> float:
    training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(**sample["net_input"])[0]
    model.train(training)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), sample["target"].view(-1)).item()


@pytest.mark.parametrize("name", ["ts_lm", "stock", "bare"])
def test_each_step_trains_its_model(runs, name):
    run = {r.name: r for r in runs}[name]
    assert run.sample is runs[0].sample and tuple(run.sample["target"].shape) == (4, 16)
    before = [p.detach().clone() for p in run.model.parameters()]
    loss = loss_of(run.model, run.sample)
    run.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, run.model.parameters()) if p.requires_grad)
    assert loss_of(run.model, run.sample) < loss - 1e-3


def test_the_models_are_the_same_size_and_the_bare_loop_trains_the_ts_lm_object(runs):
    ts, stock, bare = runs
    assert "TsTrainer.train_step" in ts.what and "TsTrainer.train_step" in stock.what
    assert bare.model is ts.model and stock.model is not ts.model
    count = [sum(p.numel() for p in r.model.parameters()) for r in (ts, stock)]
    assert 0.5 < count[0] / count[1] < 2


def test_counting_a_step_sees_adam_host_reads_but_counts_no_optimizer_sync(runs):
    bare = runs[2]
    device = so.DeviceTensors()
    so.warm_up(bare, device, 2)
    ops, syncs = so.count(bare, device)
    n_params = len(list(bare.model.parameters()))
    assert ops.counts["aten._local_scalar_dense.default"] >= n_params  # Adam's step counts, on the host
    assert not any("step_overhead.py" in site for _, site in syncs.sites)  # none from the loop's Adam step


def test_main_prints_the_table_and_the_result(capsys):
    so.main(["--model-args", f"--arch ts_lm {TINY}", "--stock-args",
             f"--arch transformer_lm {TINY} --decoder-input-dim 32 --decoder-output-dim 32", "--vocab", "40",
             "--batch-size", "2", "--tokens-per-sample", "8", "--warmup", "1", "--steps", "2", "--repeats", "2"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| ts_lm", "| stock", "| bare"))]
    assert len(rows) == 3 and all(len(row.split("|")) == 8 for row in rows)
    assert "RESULT ts_lm/bare " in out and "host syncs of ts_lm" in out


def test_a_fairseq_training_step_syncs_only_to_skip_a_non_finite_update(runs):
    """The plugin's trainer step, as a CUDA run would see it: the skip test of a non-finite gradient norm
    (ours, then fairseq's same test right after it, nothing queued between); the decoder's padding test
    reads the layout the trainer found on the host (stock ``transformer_lm``'s, on the same batch and
    trainer, reads the device); no sync in the step's logging (fairseq's per-step
    ``get_smoothed_values`` and its second ``isfinite`` were three more)."""
    def sites(run) -> list[str]:
        device = so.DeviceTensors()
        so.warm_up(run, device, 2)
        _, syncs = so.count(run, device)
        return sorted(site.split(" ")[0].rsplit(":", 1)[0] for (_, site), n in syncs.sites.items() for _ in range(n))

    norm_tests = ["fairseq/trainer.py", "torchscale_fairseq/integration/trainer.py"]
    assert sites(runs[0]) == norm_tests
    assert sites(runs[1]) == sorted([*norm_tests, "fairseq/models/transformer/transformer_decoder.py"])
