"""``--ts-fused-master-step`` (``optim/master_adamw.py``, its Triton kernel run by Triton's interpreter on the
CPU) against its references: AdamW by hand in float64, torch's fused AdamW on the fp32 gradients that fairseq's
wrapper copies (with the pending multiply as its ``grad_scale``) and the copy back, and ``--bf16`` training
with the wrapper's own path (the flag off)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from tests.optim.test_flat_master import trainer
from tests.workers.dist_harness import sample_of
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.optim import master_adamw_kernel
from torchscale_fairseq.optim.master_adamw import BLOCK, MasterAdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
SHAPES = [(300, 7), (5,), (BLOCK + 1,), (2 * BLOCK,), (3,)]  # sizes across and on program boundaries
ALIGNED_SHAPES = [(64, 16), (48,), (BLOCK + 16,), (2 * BLOCK,), (16,)]  # numels of 16: the vector variant


class _Spy:
    """The interpreter's kernel, recording each launch's ``ALIGNED``."""

    def __init__(self, kernel):
        self.kernel, self.aligned = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.aligned.append(kwargs["ALIGNED"])
            return self.kernel[grid](*args, **kwargs)

        return launch


def _state(seed: int = 0, shapes=SHAPES):
    """16-bit parameters, their fp32 masters and a fused AdamW over the masters, after one torch step (which makes
    its state), the parameters synced from the masters."""
    g = torch.Generator().manual_seed(seed)
    masters = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    optimizer = torch.optim.AdamW(masters, fused=True, **HYPER)
    for p in masters:
        p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()
    return [p.detach().bfloat16() for p in masters], masters, optimizer


def _grads(seed: int, missing: int | None = 1, shapes=SHAPES) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(s, generator=g) * 30).bfloat16() for s in shapes]
    if missing is not None:
        grads[missing] = None  # an expert no token reached: fairseq's wrapper steps it with a zero gradient
    return grads


def adamw_float64(master, m, v, t, g, scale):
    beta1, beta2 = HYPER["betas"]
    g = g / scale
    p = master - HYPER["lr"] * HYPER["weight_decay"] * master
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    return p - HYPER["lr"] / (1 - beta1**t) * m / ((v / (1 - beta2**t)).sqrt() + HYPER["eps"]), m, v


@pytest.mark.parametrize("shapes", [SHAPES, ALIGNED_SHAPES], ids=["scalar", "vector"])
@pytest.mark.parametrize("scale", [512.0, "tensor"])
def test_three_updates_equal_float64_adamw_and_torchs_fused_step_on_the_copies(scale, shapes, monkeypatch):
    spy = _Spy(master_adamw_kernel.KERNELS["cpu"])
    monkeypatch.setitem(master_adamw_kernel.KERNELS, "cpu", spy)
    params16, masters, optimizer = _state(shapes=shapes)
    ref16, ref_masters, ref_optimizer = _state(shapes=shapes)
    start = [(p.detach().double(), optimizer.state[p]["exp_avg"].double(), optimizer.state[p]["exp_avg_sq"].double())
             for p in masters]
    kernel = MasterAdamW(optimizer)
    assert kernel.ready(masters)
    divisor = torch.tensor(512.0) if scale == "tensor" else scale
    for update in range(3):
        grads = _grads(update + 1, shapes=shapes)
        for p16, g in zip(params16, grads):
            p16.grad = g
        kernel.step(params16, masters, divisor)
        for p, g in zip(ref_masters, grads):  # the wrapper: fp32 copies (zeros where none), fused step, copy back
            p.grad = torch.zeros_like(p) if g is None else g.float()
        ref_optimizer.grad_scale = torch.tensor([512.0])
        ref_optimizer.step()
        for k, (p, m, v) in enumerate(start):
            g = grads[k].double() if grads[k] is not None else torch.zeros_like(p)
            start[k] = adamw_float64(p, m, v, update + 2, g, 512.0)
    for k, (p16, p, ref) in enumerate(zip(params16, masters, ref_masters)):
        state, ref_state = optimizer.state[p], ref_optimizer.state[ref]
        assert float(state["step"]) == float(ref_state["step"]) == 4.0
        for got, want in ((p, ref), (state["exp_avg"], ref_state["exp_avg"]),
                          (state["exp_avg_sq"], ref_state["exp_avg_sq"])):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=2e-6, atol=1e-7)
        for got, want in zip((p, state["exp_avg"], state["exp_avg_sq"]), start[k]):
            assert float((got.detach().double() - want).abs().max() / want.abs().max()) < 1e-6
        assert torch.equal(p16, p.detach().bfloat16())  # rounded to nearest even, as torch's copy back
    assert spy.aligned == [shapes is ALIGNED_SHAPES] * 3


def test_a_skipped_update_writes_nothing_and_keeps_the_step_counts():
    params16, masters, optimizer = _state()
    before = [t.clone() for p in masters for t in (p.detach(), *optimizer.state[p].values())]
    before16 = [p.clone() for p in params16]
    for p16, g in zip(params16, _grads(1, missing=None)):
        p16.grad = g
    kernel = MasterAdamW(optimizer)
    optimizer.found_inf = torch.ones(())
    kernel.step(params16, masters, 1.0)
    after = [t for p in masters for t in (p.detach(), *optimizer.state[p].values())]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and all(map(torch.equal, before16, params16))
    optimizer.found_inf = torch.zeros(())
    kernel.step(params16, masters, 1.0)
    assert all(float(optimizer.state[p]["step"]) == 2.0 for p in masters)
    assert not torch.equal(before[0], masters[0].detach())


def test_nan_masters_stay_nan_in_bfloat16():
    params16, masters, optimizer = _state()
    masters[0].data[0, 0] = float("nan")
    for p16, g in zip(params16, _grads(1, missing=None)):
        p16.grad = g
    MasterAdamW(optimizer).step(params16, masters, 1.0)
    assert torch.isnan(params16[0][0, 0]) and torch.equal(params16[0][1:], masters[0].detach()[1:].bfloat16())


def _train(lm_data, monkeypatch, *flags: str, updates: int = 5):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    t = trainer(lm_data, "--bf16", "--optimizer", "ts_adamw", *flags)
    for k in range(updates):
        t.train_step([sample_of(torch.randint(4, 30, (4, 17), generator=torch.Generator().manual_seed(k)))])
    return t


@pytest.mark.parametrize("extra", [[], ["--clip-norm", "1e-4"], ["--ts-sync-free-step"]])
def test_training_equals_the_wrappers_own_path(lm_data, monkeypatch, extra):
    """Five ``--bf16`` updates (the first by torch's step, which makes its state): the same fp32 masters, moments and
    bf16 parameters as without the flag, to fp32 rounding; the same gradient norm; no fp32 gradients kept."""
    fused = _train(lm_data, monkeypatch, "--ts-fused-master-step", *extra)
    plain = _train(lm_data, monkeypatch, *extra)
    opt, ref = fused.optimizer, plain.optimizer
    assert opt.master_adamw is not None and opt.master_adamw.launched and ref.master_adamw is None
    assert all(p.grad is None for p in opt.fp32_params)
    for p, q, p16, q16 in zip(opt.fp32_params, ref.fp32_params, opt.fp16_params, ref.fp16_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.fp32_optimizer.optimizer.state[p][key],
                                       ref.fp32_optimizer.optimizer.state[q][key], rtol=1e-4, atol=1e-9)
        assert torch.equal(p16.detach(), p.detach().bfloat16())
        assert float((p16.detach().float() - q16.detach().float()).abs().max()) <= 2 ** -7 * float(q.abs().max())
    moved = max(float((p.detach() - q.detach()).abs().max()) for p, q in
                zip(opt.fp32_params, trainer(lm_data, "--bf16").optimizer.fp32_params))
    assert moved > 1e-3
    g = torch.Generator().manual_seed(9)
    for p16, q16 in zip(opt.fp16_params, ref.fp16_params):  # the norm of the same gradients, either way
        p16.grad = q16.grad = torch.randn(p16.shape, generator=g).bfloat16()
    opt._needs_sync = ref._needs_sync = True
    opt._multiply_factor = ref._multiply_factor = 0.5
    assert float(opt.clip_grad_norm(0.0)) == pytest.approx(float(ref.clip_grad_norm(0.0)), rel=1e-6)
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


def test_a_kernel_that_does_not_build_leaves_the_wrappers_path_in_one_warning(lm_data, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nmore")

    monkeypatch.setitem(master_adamw_kernel.KERNELS, "cpu", _Grid(broken))
    with caplog.at_level(logging.WARNING):
        fused = _train(lm_data, monkeypatch, "--ts-fused-master-step")
    plain = _train(lm_data, monkeypatch)
    assert fused.optimizer.master_adamw is None
    lines = [r.getMessage() for r in caplog.records if "--ts-fused-master-step" in r.getMessage()]
    assert len(lines) == 1 and "did not build (RuntimeError: PassManager::run failed)" in lines[0]
    for p, q in zip(fused.optimizer.fp32_params, plain.optimizer.fp32_params):
        assert torch.equal(p.detach(), q.detach())


class _Grid:
    """A kernel object whose launch (``kernel[grid](...)``) calls ``fn``."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


@pytest.mark.parametrize("flags, message", [
    (["--ts-fused-master-step"], "--ts-fused-master-step steps --bf16's fp32 masters: add --bf16"),
    (["--bf16", "--ts-fused-master-step", "--optimizer", "adam"], "is AdamW's update: use --optimizer ts_adamw"),
    (["--bf16", "--ts-fused-master-step", "--optimizer", "ts_adamw", "--adamw-impl", "foreach"],
     "drop --adamw-impl foreach"),
    (["--memory-efficient-bf16", "--ts-fused-master-step", "--optimizer", "ts_adamw"], "--memory-efficient-bf16"),
])
def test_refusals_are_one_line(lm_data, monkeypatch, flags, message):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(TsConfigError, match=message) as error:
        trainer(lm_data, *flags)
    assert "\n" not in str(error.value)


def test_the_cpu_is_refused_outside_tritons_interpreter(lm_data, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(TsConfigError, match="runs a Triton kernel on a CUDA device"):
        trainer(lm_data, "--bf16", "--optimizer", "ts_adamw", "--ts-fused-master-step")


def test_the_chunk_table_covers_every_element_once():
    params16, masters, optimizer = _state()
    kernel = MasterAdamW(optimizer)
    numels = tuple(p.numel() for p in masters)
    param, start = kernel._chunk_tables(numels, torch.device("cpu"))
    covered = [set() for _ in numels]
    for i, s in zip(param.tolist(), start.tolist()):
        covered[i].update(range(s, min(s + BLOCK, numels[i])))
    assert [len(c) for c in covered] == list(numels)
    assert len(param) == sum(math.ceil(n / BLOCK) for n in numels)
