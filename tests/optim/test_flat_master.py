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


@pytest.mark.parametrize("missing", ["none", "one", "all"])
@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16", "--fp16-no-flatten-grads"], ["--fp16"]])
def test_zero_grad_leaves_what_fairseqs_leaves_with_one_fill(lm_data, precision, missing):
    """After an update: the 16-bit gradients gone, every master gradient zero (one without a gradient, or all,
    left without), nothing to sync and fp16's multiply factor reset, as fairseq's own ``zero_grad`` on the same
    optimizer leaves them; per-parameter masters are zeroed by one ``_foreach_zero_``, not one ``zero_`` each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

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
        with Ops() as ops:
            zero_grad(opt)
        states.append(([p.grad for p in opt.fp16_params], [m.grad for m in masters], opt._needs_sync,
                       opt._multiply_factor, ops.names))
        for m in without:  # the next update's sync gives them gradients again
            m.grad = torch.zeros_like(m)
    (ours, ours_masters, ours_sync, ours_factor, ours_ops), (stock, stock_masters, *stock_rest, stock_ops) = states
    assert ours == stock == [None] * len(opt.fp16_params)
    left_without = [any(m is w for w in without) for m in masters]
    assert [m is None for m in ours_masters] == [m is None for m in stock_masters] == left_without
    assert all(torch.equal(a, b) and not a.any() for a, b in zip(ours_masters, stock_masters) if a is not None)
    assert [ours_sync, ours_factor] == stock_rest
    if not opt.has_flat_params:
        assert stock_ops.count("zero_") == len(masters) - len(without)
        assert ours_ops.count("_foreach_zero_") == (missing != "all") and "zero_" not in ours_ops
