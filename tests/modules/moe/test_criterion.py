"""MoE criterions: the gradients of loss = base + w * S * sum_l L_l (+ w_z * S * sum_l Z_l, the router
z-loss), the auxiliary terms differentiated inside the MoE layers with the scale set before the
forward; the returned and reported loss = base; logged figures; the sample size known in advance."""

from __future__ import annotations

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.logging import metrics

from tests.helpers.cli_utils import USER_DIR
from tests.workers.dist_harness import sample_of
from torchscale_fairseq.criterions.moe_terms import criterion_sample_size
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.moe.aux_loss import aux_loss_scales, set_aux_loss_scale
from torchscale_fairseq.modules.moe.layer import MoELayer


def _build(data, criterion: str, *extra: str):
    argv = [str(data), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_tiny", "--cpu",
            "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
            "--decoder-layers", "2", "--tokens-per-sample", "16", "--dropout", "0", "--criterion", criterion,
            "--optimizer", "adam", *extra]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    return task, task.build_model(cfg.model), task.build_criterion(cfg.criterion)


@pytest.fixture(scope="module")
def moe_lm(lm_data):
    """Two MoE layers (4 experts each) under ``moe_cross_entropy`` with both terms weighted, built
    once for the tests that only run it (``--moe-gate-loss-wt 0.05 --moe-z-loss-wt 0.002``)."""
    return _build(lm_data, "moe_cross_entropy", "--moe-expert-count", "4", "--moe-freq", "1",
                  "--moe-gate-loss-wt", "0.05", "--moe-z-loss-wt", "0.002")


def _sample(task) -> dict:
    d = task.target_dictionary
    return sample_of(torch.randint(d.pad() + 1, len(d), (4, 17), generator=torch.Generator().manual_seed(3)))


def _moe_layers(model) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _grads(model) -> list[torch.Tensor]:
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("loss_scale,ignored", [(1.0, False), (128.0, False), (128.0, True)])
def test_gradients_equal_the_loss_with_the_moe_terms(moe_lm, loss_scale, ignored):
    """``loss_scale * d/dtheta (base + w S sum_l L_l + w_z S sum_l Z_l)`` written out on one forward
    (cross-entropy by hand, the layers' losses added) equals the gradient of the criterion's returned
    (base) loss times ``loss_scale`` with the layers' scales set from the sample size; an ignored
    (dummy) batch, its loss times 0 as fairseq's ``ignore_grad``, has no gradient at all."""
    task, model, crit = moe_lm
    model.eval()
    sample = _sample(task)
    size = criterion_sample_size(crit, sample)
    layers = _moe_layers(model)
    (scale,) = aux_loss_scales([size], [ignored], 0.05, 0.002, loss_scale, torch.device("cpu"))
    set_aux_loss_scale(layers, scale)
    loss, returned_size, log = crit(model, sample)
    assert returned_size == size and float(loss) == pytest.approx(float(log["loss"]), rel=1e-6)
    (loss * (0.0 if ignored else loss_scale)).backward()
    ours = _grads(model)
    set_aux_loss_scale(layers, None)
    logits, extra = model(**sample["net_input"])
    base = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), sample["target"].view(-1),
                                             ignore_index=task.target_dictionary.pad(), reduction="sum")
    assert float(base) == pytest.approx(float(loss), rel=1e-5)
    gates = sum(aux.balance_loss for aux in extra["moe"])
    zs = sum(aux.z_loss for aux in extra["moe"])
    ((base + 0.05 * size * gates + 0.002 * size * zs) * (0.0 if ignored else loss_scale)).backward()
    reference = _grads(model)
    router = [i for i, (name, _) in enumerate(model.named_parameters()) if "router" in name]
    assert router and all(reference[i].abs().sum() > 0 for i in router) != ignored
    for (name, _), a, b in zip(model.named_parameters(), ours, reference):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * loss_scale), name
    if not ignored:  # the terms matter: without them the routers' gradients differ
        set_aux_loss_scale(layers, None)
        crit(model, sample)[0].mul(loss_scale).backward()
        plain = _grads(model)
        assert not all(torch.allclose(plain[i], reference[i], rtol=1e-5) for i in router)


def test_sample_size_is_known_before_the_forward(lm_data, moe_lm):
    """:func:`criterion_sample_size` gives what the criterion returns (tokens; sentences with
    ``--sentence-avg``)."""
    for task, model, crit in (moe_lm, _build(lm_data, "moe_cross_entropy", "--moe-expert-count", "4",
                                             "--sentence-avg")):
        sample = _sample(task)
        assert criterion_sample_size(crit, sample) == crit(model, sample)[1]


def test_loss_adds_weighted_balance_term_and_reports_base(lm_data, moe_lm):
    task, model, moe_crit = moe_lm
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
    assert float(loss) == pytest.approx(float(base_loss), rel=1e-6)  # the terms are differentiated in the layers
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


def test_router_z_loss_term_equals_its_formula(moe_lm):
    """``--moe-z-loss-wt w``: the z-loss ``sum_l mean_t (logsumexp_e s_te)^2`` (ST-MoE eq. 5) on the
    scores each router returned (captured by forward hooks) is what the layers return and what is
    logged as ``moe_z_loss`` (times S), whatever ``w``."""
    task, model, crit = moe_lm
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
    assert float(sum(aux.z_loss for aux in model(**sample["net_input"])[1]["moe"])) == pytest.approx(z, rel=1e-5)
    assert float(loss) == pytest.approx(float(log["loss"]), rel=1e-6)
    assert log["moe_z_loss"] == pytest.approx(z * size, rel=1e-5)
    with metrics.aggregate() as agg:
        type(crit).reduce_metrics([log])
    assert agg.get_smoothed_values()["moe_z_loss"] == pytest.approx(z, abs=1e-4)
    crit.moe_z_loss_wt = 0.0
    try:
        _, _, log_off = crit(model, sample)
    finally:
        crit.moe_z_loss_wt = 0.002  # the shared criterion's weight
    assert log_off["moe_z_loss"] == pytest.approx(log["moe_z_loss"], rel=1e-6)


@pytest.mark.parametrize("flag", ["--moe-z-loss-wt", "--moe-gate-loss-wt"])
def test_negative_loss_weight_is_refused(lm_data, flag):
    with pytest.raises(TsConfigError, match=f"^{flag} -1.0 is negative: use 0 \\(off\\) or a positive weight$"):
        _build(lm_data, "moe_cross_entropy", "--moe-expert-count", "4", flag, "-1")
