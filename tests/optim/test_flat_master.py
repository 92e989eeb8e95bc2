"""``--bf16`` / ``--fp16``'s fp32 masters under the plugin's trainer (``optim/flat_master.py``): its
multi-tensor copies give, bit for bit, what fairseq's own per-parameter copies
(``fairseq.optim.FP16Optimizer``'s methods, called on the same optimizer) give, in both directions,
for per-parameter masters (``--bf16``: fairseq never flattens them) and for ``--fp16``'s flat master."""

from __future__ import annotations

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.optim import FP16Optimizer

from tests.helpers.cli_utils import USER_DIR
from tests.workers.dist_harness import sample_of
from torchscale_fairseq.integration.trainer import TsTrainer
from torchscale_fairseq.optim.adamw import TorchAdamW
from torchscale_fairseq.optim.flat_master import ForeachFP16Optimizer


def trainer(lm_data, *extra: str) -> TsTrainer:
    argv = [str(lm_data), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_tiny", "--cpu",
            "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
            "--decoder-layers", "2", "--tokens-per-sample", "16", "--dropout", "0", "--optimizer", "adam",
            "--lr", "1e-3", "--max-tokens", "4096", *extra]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    return TsTrainer(cfg, task, model, task.build_criterion(cfg.criterion))


@pytest.mark.parametrize("flat", [False, True])
def test_multi_tensor_copies_equal_fairseqs_per_parameter_copies(lm_data, flat):
    t = trainer(lm_data, "--fp16" if flat else "--bf16")  # fairseq flattens --fp16's master, never --bf16's
    t.train_step([sample_of(torch.randint(4, 30, (4, 17), generator=torch.Generator().manual_seed(0)))])
    opt = t.optimizer
    assert type(opt) is ForeachFP16Optimizer and opt.has_flat_params == flat
    params = opt.fp16_params
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    if flat:
        params[3].grad = None  # fairseq copies zeros for a parameter without a gradient
    masters = list(opt.fp32_params.values()) if flat else list(opt.fp32_params)
    ours, stock = [], []
    for sync, out in ((ForeachFP16Optimizer._sync_fp16_grads_to_fp32, ours),
                      (FP16Optimizer._sync_fp16_grads_to_fp32, stock)):
        for m in masters:
            m.grad.fill_(float("nan"))  # every entry must be written
        opt._needs_sync = True
        sync(opt)
        out.append(torch.cat([m.grad.reshape(-1) for m in masters]))
    for m in masters:
        m.data.copy_(torch.randn(m.shape, generator=g))
    for sync, out in ((ForeachFP16Optimizer._sync_fp32_params_to_fp16, ours),
                      (FP16Optimizer._sync_fp32_params_to_fp16, stock)):
        for p in params:
            p.data.fill_(float("nan"))
        sync(opt)
        out.append(torch.cat([p.detach().reshape(-1) for p in params]))
    for got, want in zip(ours, stock):
        assert not torch.isnan(want).any()
        assert torch.equal(got, want)


def test_the_trainer_builds_it_for_bf16_and_fairseqs_wrappers_stay_elsewhere(lm_data):
    assert type(trainer(lm_data, "--bf16").optimizer) is ForeachFP16Optimizer
    assert type(trainer(lm_data, "--memory-efficient-bf16").optimizer).__name__ == "MemoryEfficientFP16Optimizer"
    assert FP16Optimizer is not ForeachFP16Optimizer and fairseq_optim_fp16() is FP16Optimizer  # scoped swap


def fairseq_optim_fp16():
    from fairseq import optim

    return optim.FP16Optimizer


class Ops:
    """The aten ops dispatched inside the block (``names``)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        names = self.names = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                names.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("missing", ["none", "one", "all"])
@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16", "--fp16-no-flatten-grads"], ["--fp16"]])
def test_after_zero_grad_the_update_reads_what_fairseqs_leaves_with_no_fill(lm_data, precision, missing, backward):
    """After ``zero_grad`` (ours, fairseq's own on the same optimizer), an update that syncs the masters reads the
    same master gradients: the 16-bit ones copied (``backward``, one parameter without a gradient) or, with no
    backward since, zeros; masters left without a gradient stay without. Ours fills nothing where the copy comes,
    and zeroes per-parameter masters by one ``_foreach_zero_`` where it does not. fp16's multiply factor restarts
    at ``1 / loss_scale`` in both; without a scaler (``--bf16``) ours restarts it at 1, where fairseq's keeps it."""
    t = trainer(lm_data, *precision)
    opt = t.optimizer
    masters = list(opt.fp32_params.values()) if opt.has_flat_params else list(opt.fp32_params)
    without = {"none": [], "one": masters[1:2], "all": masters}[missing] if not opt.has_flat_params else []
    states = []
    for zero_grad in (ForeachFP16Optimizer.zero_grad, FP16Optimizer.zero_grad):
        t.train_step([sample_of(torch.randint(4, 30, (4, 17), generator=torch.Generator().manual_seed(0)))])
        opt._needs_sync, opt._multiply_factor = True, 0.25
        assert all(m.grad is not None and m.grad.abs().sum() > 0 for m in masters)
        for m in without:
            m.grad = None
        with Ops() as zeroing:
            zero_grad(opt)
        factor = opt._multiply_factor
        assert [p.grad for p in opt.fp16_params] == [None] * len(opt.fp16_params) and not opt._needs_sync
        if backward:
            g = torch.Generator().manual_seed(1)
            for p in opt.fp16_params:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.fp16_params[2].grad = None
            opt._needs_sync = True
        with Ops() as syncing:
            opt._sync_fp16_grads_to_fp32()
        states.append(([None if m.grad is None else m.grad.clone() for m in masters], factor,
                       zeroing.names + syncing.names))
        for m in without:  # the next update's sync gives them gradients again
            m.grad = torch.zeros_like(m)
    (ours, ours_factor, ours_ops), (stock, stock_factor, stock_ops) = states
    if backward:
        left_without = [False] * len(masters)  # the copy gives every master a gradient (zeros where none)
    else:
        left_without = [any(m is w for w in without) for m in masters]
    assert [m is None for m in ours] == [m is None for m in stock] == left_without
    assert all(torch.equal(a, b) for a, b in zip(ours, stock) if a is not None)
    assert any(a is not None and a.any() for a in ours) == backward
    assert ours_factor == (stock_factor if opt.scaler is not None else 1.0)
    if backward:  # the copy overwrites every master: nothing filled
        assert not {"zero_", "_foreach_zero_", "fill_"} & set(ours_ops), ours_ops
    elif not opt.has_flat_params:
        assert ours_ops.count("_foreach_zero_") == (missing != "all") and "zero_" not in ours_ops


@pytest.mark.parametrize("extra", [[], ["--clip-norm", "1e-4"], ["--ts-sync-free-step"]])
def test_the_pending_multiply_as_the_fused_steps_scale_equals_its_own_pass(lm_data, extra, monkeypatch):
    """``--bf16 --optimizer ts_adamw`` (fused): five updates that hand fairseq's pending gradient multiply
    (``1 / tokens``; with ``--clip-norm`` a device tensor) to the fused step as ``scale`` leave the fp32 masters that
    fairseq's own multiply pass leaves, to fp32 rounding (``g / scale`` against ``g * (1 / scale)``). Fails if the
    multiply carried over from one update into the next, as under fairseq's bf16 wrapper with such a step."""
    samples = [sample_of(torch.randint(4, 30, (4, 17), generator=torch.Generator().manual_seed(k))) for k in range(5)]
    masters = {}
    for scaled in (True, False):
        if not scaled:
            monkeypatch.setattr(TorchAdamW, "supports_step_with_scale", property(lambda self: False))
        torch.manual_seed(0)
        t = trainer(lm_data, "--bf16", "--optimizer", "ts_adamw", *extra)
        assert t.optimizer.supports_step_with_scale == scaled
        for sample in samples:
            t.train_step([sample])
        masters[scaled] = [m.detach().clone() for m in t.optimizer.fp32_params]
    moved = max((a - b).abs().max().item() for a, b in zip(masters[True], trainer(lm_data, "--bf16").optimizer.fp32_params))
    assert moved > 1e-3  # the updates did move the masters
    for got, want in zip(masters[True], masters[False]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
