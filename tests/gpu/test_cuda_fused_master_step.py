"""``--ts-fused-master-step``'s Triton kernel on CUDA against its reference on the device (torch's fused AdamW on
the fp32 copies of the bf16 gradients, the pending multiply as its ``grad_scale``, then the copy back), for the
scalar and the vector variant; and ``fairseq-train`` with the flag on the fast path (with and without CUDA
graphs) tracking the same runs without it. The CPU suite checks the kernel in Triton's interpreter
(``tests/optim/test_master_adamw.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, json_logs, run_many, tool
from torchscale_fairseq.optim.master_adamw import BLOCK, MasterAdamW

pytestmark = pytest.mark.gpu

HYPER = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("shapes", [[(300, 7), (5,), (BLOCK + 1,), (1 << 20,)],
                                    [(1024, 1024), (4096,), (BLOCK + 16,), (50272, 64)]], ids=["scalar", "vector"])
def test_fused_master_step_on_cuda_equals_torchs_fused_adamw_on_the_copies(shapes):
    g = torch.Generator(device="cuda").manual_seed(0)
    start = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    masters = [torch.nn.Parameter(t.clone()) for t in start]
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    optimizers = [torch.optim.AdamW(ps, fused=True, **HYPER) for ps in (masters, reference)]
    for opt, ps in zip(optimizers, (masters, reference)):  # torch's first step makes the state
        for p, t in zip(ps, start):
            p.grad = t * 0.01
        opt.step()
    params16 = [p.detach().bfloat16() for p in masters]
    kernel, scale = MasterAdamW(optimizers[0]), torch.tensor(4096.0, device="cuda")
    for _ in range(5):
        grads = [(torch.randn(s, device="cuda", generator=g) * 50).bfloat16() for s in shapes]
        grads[1] = None
        for p16, grad in zip(params16, grads):
            p16.grad = grad
        kernel.step(params16, masters, scale)
        for p, grad in zip(reference, grads):
            p.grad = torch.zeros_like(p) if grad is None else grad.float()
        optimizers[1].grad_scale = scale.reshape(1)
        optimizers[1].step()
    for p16, p, q in zip(params16, masters, reference):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizers[0].state[p][key], optimizers[1].state[q][key], rtol=1e-5, atol=1e-9)
        assert float(optimizers[0].state[p]["step"]) == float(optimizers[1].state[q]["step"]) == 6.0
        assert torch.equal(p16, p.detach().bfloat16())


def test_fairseq_train_with_the_flag_tracks_the_fast_path(lm_data, tmp_path):
    base = [tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update", "20",
            "--no-save", "--dropout", "0.0", *[f for f in LM_TRAIN if f != "--cpu"], "--log-interval", "1", "--bf16",
            "--disable-validation", "--ts-fused-cross-entropy", "--ts-compile", "--optimizer", "ts_adamw",
            "--ts-sync-free-step", "--weight-decay", "0.01"]
    plain, fused, graphed = run_many([
        [*base, "--save-dir", tmp_path / "plain"],
        [*base, "--save-dir", tmp_path / "fused", "--ts-fused-master-step"],
        [*base, "--save-dir", tmp_path / "graphed", "--ts-fused-master-step", "--ts-cuda-graphs"],
    ])
    for run in (fused, graphed):
        assert "did not build" not in run.stdout + run.stderr, run.stderr[-3000:]  # the kernel ran, no fallback
    losses = [[float(r["loss"]) for r in json_logs(p.stdout + p.stderr, "train_inner")] for p in (plain, fused, graphed)]
    assert [len(run_losses) for run_losses in losses] == [20] * 3, losses
    assert losses[1][-1] < losses[1][0] - 0.5
    for run_losses in losses[1:]:
        for a, b in zip(losses[0], run_losses):
            assert abs(a - b) <= 0.01 * a, losses  # the same updates to fp32 rounding; bf16 parameters may differ by an ulp
