"""MoE criterions: loss = base + w * S * sum_l L_l (+ the router z-loss), reported loss = base, logged figures."""

from __future__ import annotations

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.logging import metrics

from tests.cli_utils import USER_DIR
from tests.moe.dist_harness import sample_of
from torchscale_fairseq.errors import TsConfigError


def _build(data, criterion: str, *extra: str):
    argv = [str(data), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_tiny", "--cpu",
            "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
            "--decoder-layers", "2", "--tokens-per-sample", "16", "--dropout", "0", "--criterion", criterion,
            "--optimizer", "adam", *extra]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    return task, task.build_model(cfg.model), task.build_criterion(cfg.criterion)


def _sample(task) -> dict:
    d = task.target_dictionary
    return sample_of(torch.randint(d.pad() + 1, len(d), (4, 17), generator=torch.Generator().manual_seed(3)))


def test_loss_adds_weighted_balance_term_and_reports_base(lm_data):
    task, model, moe_crit = _build(lm_data, "moe_cross_entropy", "--moe-expert-count", "4", "--moe-freq", "1",
                                   "--moe-gate-loss-wt", "0.05")
    plain = task.build_criterion(convert_namespace_to_omegaconf(options.parse_args_and_arch(
        options.get_training_parser(), [str(lm_data), "--user-dir", USER_DIR, "--task", "language_modeling",
                                        "--arch", "ts_lm_tiny", "--criterion", "cross_entropy"])).criterion)
    model.eval()
    sample = _sample(task)
    loss, size, log = moe_crit(model, sample)
    gates = [aux.balance_loss for aux in model(**sample["net_input"])[1]["moe"]]
    assert len(gates) == 2
    base_loss, _, _ = plain(model, sample)
    assert log["loss"] == pytest.approx(float(base_loss), rel=1e-6)
    assert float(loss) == pytest.approx(float(base_loss) + 0.05 * size * float(sum(gates)), rel=1e-6)
    assert log["moe_gate_loss"] == pytest.approx(float(sum(gates)) * size, rel=1e-6)
    with metrics.aggregate() as agg:
        type(moe_crit).reduce_metrics([log])
    values = agg.get_smoothed_values()
    assert values["moe_gate_loss"] == pytest.approx(float(sum(gates)), abs=1e-4)
    assert {"moe_cv_dec0", "moe_cv_dec1", "moe_drop", "moe_entropy", "loss", "ppl"} <= set(values)
    assert 0.0 <= values["moe_entropy"] <= torch.log(torch.tensor(4.0)).item() + 1e-4
    assert values["loss"] == pytest.approx(float(base_loss) / size / torch.log(torch.tensor(2.0)).item(), abs=1e-3)


def test_dense_model_under_moe_criterion(lm_data):
    task, model, crit = _build(lm_data, "moe_cross_entropy")
    loss, _, log = crit(model, _sample(task))
    assert torch.isfinite(loss) and log["moe_gate_loss"] == 0.0
    with metrics.aggregate() as agg:
        type(crit).reduce_metrics([log])
    assert agg.get_smoothed_values()["moe_gate_loss"] == 0.0


def test_router_z_loss_term_equals_its_formula(lm_data):
    """``--moe-z-loss-wt w``: loss = base + balance term + ``w * S * sum_l mean_t (logsumexp_e s_te)^2``
    (ST-MoE eq. 5) on the scores each router returned (captured by forward hooks), logged as
    ``moe_z_loss``; with ``w = 0`` the loss has no z term but ``moe_z_loss`` is still logged."""
    task, model, crit = _build(lm_data, "moe_cross_entropy", "--moe-expert-count", "4", "--moe-freq", "1",
                               "--moe-z-loss-wt", "0.002")
    routers = [m.router for m in model.modules() if hasattr(m, "router") and hasattr(m, "experts")]
    assert len(routers) == 2
    scores: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: scores.append(out.detach().double())) for r in routers]
    model.eval()
    sample = _sample(task)
    loss, size, log = crit(model, sample)
    for hook in hooks:
        hook.remove()
    assert len(scores) == 2
    z = sum(float((s.exp().sum(-1).log() ** 2).mean()) for s in scores)  # logsumexp written out
    gates = sum(float(aux.balance_loss) for aux in model(**sample["net_input"])[1]["moe"])
    base = float(log["loss"])
    assert float(loss) == pytest.approx(base + 0.01 * size * gates + 0.002 * size * z, rel=1e-6)
    assert log["moe_z_loss"] == pytest.approx(z * size, rel=1e-5)
    with metrics.aggregate() as agg:
        type(crit).reduce_metrics([log])
    assert agg.get_smoothed_values()["moe_z_loss"] == pytest.approx(z, abs=1e-4)
    crit.moe_z_loss_wt = 0.0
    loss_off, _, log_off = crit(model, sample)
    assert float(loss_off) == pytest.approx(base + 0.01 * size * gates, rel=1e-6)
    assert log_off["moe_z_loss"] == pytest.approx(log["moe_z_loss"], rel=1e-6)


@pytest.mark.parametrize("flag", ["--moe-z-loss-wt", "--moe-gate-loss-wt"])
def test_negative_loss_weight_is_refused(lm_data, flag):
    with pytest.raises(TsConfigError, match=f"^{flag} -1.0 is negative: use 0 \\(off\\) or a positive weight$"):
        _build(lm_data, "moe_cross_entropy", "--moe-expert-count", "4", flag, "-1")
