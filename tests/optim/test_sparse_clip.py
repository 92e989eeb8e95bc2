"""SparseClip against the paper's formula (section 2.3), fairseq's vanilla clipping, the
expert-duplication claim, fp16's flat master copy, flags and non-finite norms."""

from __future__ import annotations

import math
from argparse import Namespace

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.optim import build_optimizer

from tests.helpers.cli_utils import USER_DIR
from tests.workers.dist_harness import sample_of
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.clip_grad_norm import use_parallel_context
from torchscale_fairseq.integration.trainer import TsTrainer
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.optim.sparse_clip import SparseClip


def _params(num_experts: int, seed: int = 0, copies: int = 1) -> list[torch.nn.Parameter]:
    """Dense params and ``num_experts * copies`` expert params (each expert's gradient
    repeated ``copies`` times), with fixed gradients."""
    g = torch.Generator().manual_seed(seed)
    dense = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    for p in dense:
        p.grad = torch.randn(p.shape, generator=g)
    experts = []
    grads = [torch.randn(4, 3, generator=g) for _ in range(num_experts)]
    for grad in grads * copies:
        p = torch.nn.Parameter(torch.zeros(4, 3))
        p.expert = True
        p.grad = grad.clone()
        experts.append(p)
    return dense + experts


def _sparse_clip(params, experts: int, kappa: float = -1.0, base: str = "sgd") -> SparseClip:
    args = Namespace(optimizer="sparse_clip", sparse_clip_base=base, sparse_clip_kappa=kappa,
                     moe_expert_count=experts, lr=[0.1], momentum=0.0, weight_decay=0.0,
                     adam_betas="(0.9, 0.98)", adam_eps=1e-8, use_old_adam=False, fp16_adam_stats=False,
                     tpu=False)
    return build_optimizer(args, params)


def _sq(ps) -> float:
    return sum(float(p.grad.pow(2).sum()) for p in ps)


@pytest.mark.parametrize("base", ["sgd", "adam"])
def test_norm_and_clip_follow_the_formula(base):
    params = _params(4)
    dense, experts = params[:2], params[2:]
    expected = math.sqrt(_sq(dense) + _sq(experts) / 4)
    before = [p.grad.clone() for p in params]
    opt = _sparse_clip(params, 4, base=base)
    xi = expected / 3
    total = opt.clip_grad_norm(xi)
    assert float(total) == pytest.approx(expected, rel=1e-6)
    for p, g in zip(params, before):
        assert torch.allclose(p.grad, g * xi / expected, rtol=1e-5)


def test_no_clip_below_threshold_and_kappa_override():
    params = _params(4)
    expected = math.sqrt(_sq(params[:2]) + 0.3**2 * _sq(params[2:]))
    before = [p.grad.clone() for p in params]
    assert float(_sparse_clip(params, 4, kappa=0.3).clip_grad_norm(expected * 2)) == pytest.approx(expected, rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))


@pytest.mark.parametrize("experts", [0, 1])
def test_without_moe_or_one_expert_equals_vanilla_clip_norm(experts):
    params, reference = _params(experts), _params(experts)
    vanilla = build_optimizer(Namespace(optimizer="sgd", lr=[0.1], momentum=0.0, weight_decay=0.0), reference)
    use_parallel_context(vanilla, ParallelContext.single_process())  # its norm as the trainer builds it
    xi = 0.5
    assert float(_sparse_clip(params, experts).clip_grad_norm(xi)) == pytest.approx(
        float(vanilla.clip_grad_norm(xi)), rel=1e-7)
    assert math.sqrt(_sq(reference)) == pytest.approx(xi, rel=1e-5)
    for p, q in zip(params, reference):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0)


def test_duplicated_experts_keep_the_norm_while_vanilla_grows():
    sparse, vanilla = [], []
    for k in (1, 2, 4, 8):
        params = _params(4, copies=k)
        vanilla.append(math.sqrt(_sq(params)))
        sparse.append(float(_sparse_clip(params, 4 * k).clip_grad_norm(0)))
    assert sparse == pytest.approx([sparse[0]] * 4, rel=1e-6)
    assert vanilla == sorted(vanilla) and vanilla[-1] > 1.5 * vanilla[0]


def test_flat_fp16_master_keeps_expert_identity():
    """fp16's flat fp32 master (one tensor for all parameters) is split back by source."""
    params = _params(4)
    flat = torch.nn.Parameter(torch.zeros(sum(p.numel() for p in params)))
    flat.grad = torch.cat([p.grad.reshape(-1) for p in params])
    flat.ts_flat_sources = params
    expected = math.sqrt(_sq(params[:2]) + _sq(params[2:]) / 4)
    assert float(_sparse_clip([flat], 4).clip_grad_norm(0)) == pytest.approx(expected, rel=1e-6)


def _train_args(data, *extra: str) -> list[str]:
    return [str(data), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_tiny", "--cpu",
            "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
            "--decoder-layers", "2", "--tokens-per-sample", "16", "--dropout", "0", *extra]


def test_base_optimizer_flags_are_parsed(lm_data):
    parse = options.get_training_parser()
    args = options.parse_args_and_arch(parse, _train_args(
        lm_data, "--optimizer", "sparse_clip", "--sparse-clip-base", "adam", "--adam-betas", "(0.9, 0.98)",
        "--clip-norm", "1.0", "--sparse-clip-kappa", "0.25"))
    assert args.adam_betas == "(0.9, 0.98)" and args.sparse_clip_kappa == 0.25 and args.clip_norm == 1.0
    args = options.parse_args_and_arch(options.get_training_parser(), _train_args(
        lm_data, "--optimizer", "sparse_clip", "--sparse-clip-base", "sgd", "--momentum", "0.9"))
    assert args.momentum == 0.9
    with pytest.raises(TsConfigError, match="--sparse-clip-base 'nope' is not a fairseq optimizer"):
        options.parse_args_and_arch(options.get_training_parser(), _train_args(
            lm_data, "--optimizer", "sparse_clip", "--sparse-clip-base", "nope"))


def test_non_finite_norm_skips_the_update(lm_data):
    argv = _train_args(lm_data, "--moe-expert-count", "2", "--criterion", "moe_cross_entropy", "--optimizer",
                       "sparse_clip", "--sparse-clip-base", "adam", "--clip-norm", "1.0", "--lr", "1e-2",
                       "--max-tokens", "4096")
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    trainer = TsTrainer(cfg, task, model, task.build_criterion(cfg.criterion))
    d = task.target_dictionary
    sample = sample_of(torch.randint(d.pad() + 1, len(d), (4, 17), generator=torch.Generator().manual_seed(0)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expert = next(p for p in model.parameters() if getattr(p, "expert", False))
    handle = expert.register_hook(lambda g: g * float("inf"))
    trainer.train_step([sample])
    handle.remove()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    trainer.train_step([sample])
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def _trainer(lm_data, *extra: str) -> tuple:
    argv = _train_args(lm_data, "--moe-expert-count", "2", "--criterion", "moe_cross_entropy", "--optimizer",
                       "sparse_clip", "--clip-norm", "1.0", "--lr", "1e-2", "--max-tokens", "4096", *extra)
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    return TsTrainer(cfg, task, model, task.build_criterion(cfg.criterion)), task, model


def test_flag_of_another_optimizer_is_refused_before_training(lm_data):
    """``--momentum`` belongs to sgd/nag: with ``--sparse-clip-base adam`` it would be ignored."""
    with pytest.raises(TsConfigError, match="--momentum is a flag of --optimizer (nag|sgd), not of --sparse-clip-base adam"):
        _trainer(lm_data, "--sparse-clip-base", "adam", "--momentum", "0.9")


def test_updates_skipped_in_a_row_stop_training_with_one_line(lm_data):
    trainer, task, model = _trainer(lm_data, "--sparse-clip-base", "adam", "--max-skipped-updates", "3")
    d = task.target_dictionary
    sample = sample_of(torch.randint(d.pad() + 1, len(d), (4, 17), generator=torch.Generator().manual_seed(0)))
    expert = next(p for p in model.parameters() if getattr(p, "expert", False))
    expert.register_hook(lambda g: g * float("nan"))
    trainer.train_step([sample])  # skipped (1), training goes on
    trainer.train_step([sample])  # skipped (2)
    with pytest.raises(TsConfigError, match=r"3 updates in a row skipped .*\(after update 0\)"):
        trainer.train_step([sample])
