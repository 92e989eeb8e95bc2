"""Issue 43's fast paths on CUDA against their references on the device: the fused output layer +
cross-entropy (eager chunks and the compiled chunk kernel) against float64 ``F.cross_entropy`` on
full logits; ``ts_adamw``'s fused kernel against torch's per-tensor AdamW; and ``fairseq-train`` with all
of them (``--ts-fused-cross-entropy --ts-compile --optimizer ts_adamw --bf16``) tracking the default
path's per-update losses (``--optimizer adam --bf16``), and ``--ts-sync-free-step`` the fast path's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, json_logs, run_many, tool
from torchscale_fairseq.model_parallel.linear_cross_entropy import linear_cross_entropy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_cross_entropy_on_cuda_equals_float64_full_logits(compiled):
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, dim, vocab, padded, pad = 4096 + 17, 256, 5000, 5120, 1
    hidden = torch.randn(rows, dim, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(padded, dim, device="cuda", generator=g) * 0.2).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    target[::7] = pad
    loss = linear_cross_entropy(hidden, weight, target, vocab, pad, chunk=1024, compiled=compiled)
    loss.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = F.cross_entropy(h64 @ w64[:vocab].t(), target, ignore_index=pad, reduction="sum")
    ref.backward()
    assert abs(float(loss) - float(ref)) / float(ref) < 1e-3
    for got, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        assert torch.isfinite(got).all()
        assert float((got.double() - want).norm() / want.norm()) < 1e-2
    assert float(weight.grad[vocab:].abs().max()) == 0.0


def test_ts_adamw_fused_kernel_on_cuda_equals_its_for_loop_reference():
    """``--adamw-impl fused`` (the default on CUDA) against torch's plain per-tensor AdamW on the device
    (the CPU suite checks that path against fairseq's Adam and a float64 formula)."""
    from torchscale_fairseq.optim.adamw import choose_impl

    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(64, 32), (32,), (1000,)]
    fused = [torch.randn(s, device="cuda", generator=g).requires_grad_() for s in shapes]
    plain = [p.detach().clone().requires_grad_() for p in fused]
    assert choose_impl(None, fused)[0] == "fused"
    hyper = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    optimizers = [torch.optim.AdamW(fused, fused=True, **hyper),
                  torch.optim.AdamW(plain, foreach=False, fused=False, **hyper)]
    for _ in range(5):
        grads = [torch.randn(s, device="cuda", generator=g) for s in shapes]
        for p, q, grad in zip(fused, plain, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        for opt in optimizers:
            opt.step()
    for p, q in zip(fused, plain):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fast_flags_track_the_default_path(lm_data, tmp_path):
    """The fast flags track the default path; ``--ts-sync-free-step`` on top of them changes no update
    (the same losses as logged, the same kernels; only the host's waits differ), nor does
    ``--ts-cuda-graphs`` on top of that (the same kernels, replayed), also with two micro-batches per
    update through fairseq's bf16 optimizer and validation between updates, and with MoE layers (their
    balance and z-losses' gradients set by the trainer per micro-batch, their figures logged)."""
    base = [tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update", "20",
            "--no-save", "--dropout", "0.0", *[f for f in LM_TRAIN if f != "--cpu"], "--log-interval", "1", "--bf16",
            "--disable-validation"]
    fast_flags = ["--ts-fused-cross-entropy", "--ts-compile", "--optimizer", "ts_adamw"]
    validated = [f for f in base if f != "--disable-validation"] + ["--update-freq", "2", "--validate-interval-updates",
                                                                     "5", *fast_flags, "--ts-sync-free-step"]
    moe = [*validated, "--moe-expert-count", "4", "--moe-freq", "2", "--moe-second-expert-policy", "all",
           "--criterion", "moe_cross_entropy", "--moe-z-loss-wt", "0.001"]
    default, fast, sync_free, graphed, accumulated, accumulated_graphed, moe_plain, moe_graphed = run_many([
        base + ["--save-dir", tmp_path / "default"],
        [*base, "--save-dir", tmp_path / "fast", *fast_flags],
        [*base, "--save-dir", tmp_path / "sync_free", *fast_flags, "--ts-sync-free-step"],
        [*base, "--save-dir", tmp_path / "graphed", *fast_flags, "--ts-sync-free-step", "--ts-cuda-graphs"],
        [*validated, "--save-dir", tmp_path / "accumulated"],
        [*validated, "--save-dir", tmp_path / "accumulated_graphed", "--ts-cuda-graphs"],
        [*moe, "--save-dir", tmp_path / "moe"],
        [*moe, "--save-dir", tmp_path / "moe_graphed", "--ts-cuda-graphs"],
    ])
    for run in (fast, sync_free, graphed, accumulated, accumulated_graphed, moe_plain, moe_graphed):
        assert "ran every compiled function whole" in run.stdout + run.stderr, run.stderr[-3000:]
    losses = [[float(r["loss"]) for r in json_logs(p.stdout + p.stderr, "train_inner")]
              for p in (default, fast, sync_free, graphed, accumulated, accumulated_graphed)]
    assert [len(run_losses) for run_losses in losses] == [20] * 6, losses
    assert losses[1][-1] < losses[1][0] - 0.5
    for a, b in zip(*losses[:2]):
        assert abs(a - b) <= 0.05 * a, losses  # bf16 rounding of differently ordered sums, over 20 updates
    for a, b in zip(*losses[1:3]):
        assert abs(a - b) <= 2e-3, losses  # logged to 3 decimals; only atomics' order may differ
    assert "skipped on the device" not in sync_free.stdout + sync_free.stderr
    assert "--ts-cuda-graphs: 2 layers captured at input shape" in graphed.stdout + graphed.stderr
    for a, b in zip(*losses[2:4]):
        assert abs(a - b) <= 2e-3, losses
    for a, b in zip(*losses[4:]):
        assert abs(a - b) <= 2e-3, losses
    valid = [[float(r["valid_loss"]) for r in json_logs(p.stdout + p.stderr, "valid")]
             for p in (accumulated, accumulated_graphed)]
    assert len(valid[0]) == len(valid[1]) >= 4 and all(abs(a - b) <= 2e-3 for a, b in zip(*valid)), valid
    assert "--ts-cuda-graphs: 2 layers captured at input shape" in moe_graphed.stdout + moe_graphed.stderr
    moe_logs = [json_logs(p.stdout + p.stderr, "train_inner") for p in (moe_plain, moe_graphed)]
    assert len(moe_logs[0]) == len(moe_logs[1]) == 20, moe_logs
    for plain_log, graphed_log in zip(*moe_logs):
        for key in ("loss", "moe_gate_loss", "moe_z_loss", "moe_cv_dec1", "moe_drop"):
            assert abs(float(plain_log[key]) - float(graphed_log[key])) <= 2e-3 * max(1.0, abs(float(plain_log[key]))), (
                key, moe_logs)
