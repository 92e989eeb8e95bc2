"""``--ts-fused-cross-entropy``: the output layer and the cross-entropy computed in chunks
(``model_parallel/linear_cross_entropy.py``) equal the full-logits path: against float64
``F.cross_entropy`` on ``h W^T`` (loss and both gradients), through the criterion on ts models
(every parameter's gradient, with MoE balance loss), through ``fairseq-train`` (per-update
losses and validation), and its compiled chunk kernel equals the plain PyTorch one. The
2-rank vocabulary-parallel case is in ``tests/model_parallel/test_mp_layers.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, json_logs, last_error_line, run, run_many, tool
from tests.helpers.model_utils import FakeTask, build, dictionary
from torchscale_fairseq.criterions import moe_criterions, vocab_parallel
from torchscale_fairseq.model_parallel.linear_cross_entropy import linear_cross_entropy

N, D, V, PAD = 23, 16, 50, 1


def reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab: int):
    """Loss and gradients in float64 from the full logits of the first ``vocab`` rows of ``weight``."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = F.cross_entropy(h @ w[:vocab].t(), target, ignore_index=PAD, reduction="sum")
    loss.backward()
    return loss, h.grad, w.grad


def inputs(dtype=torch.float32, rows: int = V + 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(rows, D, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    target[[3, 10, 11]] = PAD
    return hidden, weight, target


@pytest.mark.parametrize("chunk", [1, 4, N, 64])
def test_loss_and_gradients_equal_full_logits(chunk):
    """Padding rows of the weight beyond the vocabulary (6 here) are never predicted and get zero gradient."""
    hidden, weight, target = inputs()
    loss = linear_cross_entropy(hidden, weight, target, V, PAD, chunk=chunk)
    (2.5 * loss).backward()  # the incoming gradient scales both
    ref, grad_h, grad_w = reference(hidden, weight, target, V)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(hidden.grad.double(), 2.5 * grad_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), 2.5 * grad_w, rtol=1e-5, atol=1e-6)
    assert weight.grad[V:].abs().max() == 0


def test_bf16_within_rounding():
    hidden, weight, target = inputs(torch.bfloat16)
    loss = linear_cross_entropy(hidden, weight, target, V, PAD, chunk=8)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    ref, grad_h, grad_w = reference(hidden, weight, target, V)
    assert abs(loss.double() - ref) / ref < 1e-3  # bf16 logits (rounded at 2^-9), fp32 softmax
    unfused = F.cross_entropy((hidden @ weight[:V].t()).float(), target, ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, unfused, rtol=1e-5, atol=0)  # the full-logits path rounds the same logits
    for got, want in ((hidden.grad, grad_h), (weight.grad, grad_w)):
        assert (got.double() - want).norm() / want.norm() < 1e-2


def test_under_autocast_the_gemms_run_in_its_dtype_and_the_gradients_keep_the_inputs():
    """``--amp``: fp32 features and weight, GEMMs in autocast's bf16 (as ``F.linear`` under autocast),
    fp32 gradients within bf16 rounding of float64."""
    hidden, weight, target = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, target, V, PAD, chunk=8)
        unfused = F.cross_entropy(F.linear(hidden, weight[:V]).float(), target, ignore_index=PAD, reduction="sum")
    loss.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(loss, unfused.detach(), rtol=1e-5, atol=0)  # the same bf16 logits
    ref, grad_h, grad_w = reference(hidden, weight, target, V)
    assert abs(loss.double() - ref) / ref < 1e-3
    for got, want in ((hidden.grad, grad_h), (weight.grad, grad_w)):
        assert (got.double() - want).norm() / want.norm() < 1e-2


def test_without_grad_same_loss_and_no_gradient_work():
    hidden, weight, target = inputs()
    with_grad = linear_cross_entropy(hidden, weight, target, V, PAD, chunk=5)
    with torch.no_grad():
        without = linear_cross_entropy(hidden, weight, target, V, PAD, chunk=5)
    assert not without.requires_grad
    torch.testing.assert_close(without, with_grad.detach(), rtol=0, atol=0)


def test_compiled_chunk_kernel_equals_plain_pytorch():
    torch._dynamo.reset()
    hidden, weight, target = inputs()
    eager = linear_cross_entropy(hidden, weight, target, V, PAD, chunk=8)
    eager.backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    compiled = linear_cross_entropy(hidden, weight, target, V, PAD, chunk=8, compiled=True)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)
    torch.testing.assert_close(hidden.grad, expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, expected[1], rtol=1e-5, atol=1e-6)


def _grads(model, criterion, sample) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, _, logging_output = criterion(model, sample)
    loss.backward()
    return logging_output["loss"], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind,moe", [("lm", False), ("lm", True), ("mt", False)])
def test_criterion_fused_equals_full_logits(kind, moe):
    """Same model weights, fused and not: the logged loss and every parameter's gradient (the tied
    embedding's gets both its input and output parts; an MoE model's balance loss is added)."""
    d = dictionary()
    extra = dict(moe_expert_count=4, moe_freq=1, moe_second_expert_policy="all") if moe else {}
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(d.nspecial, len(d), (3, 9), generator=g)
    tokens[2, 6:] = d.pad()
    if kind == "lm":
        net_input = {"src_tokens": tokens, "src_lengths": torch.tensor([9, 9, 6])}
    else:
        net_input = {"src_tokens": tokens.flip(1), "src_lengths": torch.tensor([9, 9, 9]), "prev_output_tokens": tokens}
    sample = {"net_input": net_input, "target": tokens, "ntokens": int(tokens.ne(d.pad()).sum()), "nsentences": 3}
    criterion_cls = moe_criterions.MoeCrossEntropyCriterion if moe else vocab_parallel.CrossEntropyCriterion
    criterion = criterion_cls(FakeTask(d), sentence_avg=False)
    torch.manual_seed(0)
    plain = build(kind, d, **extra)
    torch.manual_seed(0)
    fused = build(kind, d, ts_fused_cross_entropy=True, ts_loss_chunk_tokens=5, **extra)
    assert fused.decoder.fuses_output_loss and not plain.decoder.fuses_output_loss
    fused.load_state_dict(plain.state_dict())
    for m in (plain, fused):
        m.train()
    torch.manual_seed(7)
    loss_plain, grads_plain = _grads(plain, criterion, sample)
    torch.manual_seed(7)
    loss_fused, grads_fused = _grads(fused, criterion, sample)
    torch.testing.assert_close(loss_fused, loss_plain, rtol=1e-6, atol=1e-6)
    assert grads_fused.keys() == grads_plain.keys()
    for name, grad in grads_plain.items():
        scale = float(grad.abs().max())  # float rounding of sums over tokens, relative to the gradient's size
        torch.testing.assert_close(grads_fused[name], grad, rtol=1e-5, atol=1e-6 * max(scale, 1.0), msg=name)


def test_fairseq_train_losses_and_validation_equal(lm_data, tmp_path):
    """Five updates of ts_lm_tiny with and without the flag: the same train and validation losses."""
    base = [tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update", "5",
            "--no-save", "--dropout", "0.0", *LM_TRAIN, "--log-interval", "1"]
    procs = run_many([base + ["--save-dir", tmp_path / "plain"],
                      base + ["--save-dir", tmp_path / "fused", "--ts-fused-cross-entropy",
                              "--ts-loss-chunk-tokens", "100"]])
    got = [[float(r["loss"]) for r in json_logs(p.stdout + p.stderr, "train_inner")] for p in procs]
    valid = [[float(r["valid_loss"]) for r in json_logs(p.stdout + p.stderr, "valid")] for p in procs]
    # fairseq logs 3 decimals: equal up to one rounding step
    assert len(got[0]) == 5 and max(abs(a - b) for a, b in zip(*got)) <= 0.0011, got
    assert valid[0] and max(abs(a - b) for a, b in zip(*valid)) <= 0.0011, valid


@pytest.mark.parametrize("flags,message", [
    (["--ts-loss-chunk-tokens", "0"], "--ts-loss-chunk-tokens 0 is not a positive number of tokens"),
    (["--ts-fused-cross-entropy", "--adaptive-softmax-cutoff", "20"], "--adaptive-softmax-cutoff replaces it"),
    (["--ts-fused-cross-entropy", "--criterion", "label_smoothed_cross_entropy"],
     "computes the loss in the criterions cross_entropy and moe_cross_entropy, not --criterion "
     "label_smoothed_cross_entropy"),
    (["--ts-fused-cross-entropy", "--find-unused-parameters"], "--find-unused-parameters and --ddp-backend"),
])
def test_bad_flags_are_one_line_errors(lm_data, tmp_path, flags, message):
    proc = run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update", "1",
                "--save-dir", tmp_path, *LM_TRAIN, *flags], check=False)
    assert proc.returncode != 0 and message in last_error_line(proc), last_error_line(proc)
