"""``--ts-attention-backend``: forcing SDPA's math kernel (the plain PyTorch reference) gives the
default path's logits and gradients; the one log line at a stack's first forward names the kernel
that the profiler then sees run; bad values are refused in one line."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from tests.helpers import model_utils
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.multihead_attention import MultiheadAttention

KERNEL_OPS = {"FLASH_ATTENTION": "aten::_scaled_dot_product_flash_attention_for_cpu",
              "MATH": "aten::_scaled_dot_product_attention_math"}
LOGGER = "torchscale_fairseq.architecture.pipeline_stage"


def build(**overrides):
    torch.manual_seed(0)
    return model_utils.build("lm", **overrides)


def step(model, tokens):
    """Logits, loss gradients and the SDPA kernel ops the profiler saw in one training forward/backward."""
    with profile() as prof:
        logits, _ = model(tokens)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    ops = {e.key for e in prof.key_averages()} & set(KERNEL_OPS.values())
    return logits, {n: p.grad for n, p in model.named_parameters()}, ops


def test_forcing_math_equals_the_default_path():
    tokens = torch.randint(4, 40, (3, 24))
    default, math = build(), build(ts_attention_backend="math")
    logits, grads, ops = step(default, tokens)
    m_logits, m_grads, m_ops = step(math, tokens)
    assert ops == {KERNEL_OPS["FLASH_ATTENTION"]} and m_ops == {KERNEL_OPS["MATH"]}  # two kernels ran
    torch.testing.assert_close(m_logits, logits, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(m_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("overrides, kernel, how", [
    ({}, "FLASH_ATTENTION", "SDPA's choice"),
    ({"attention_dropout": 0.1}, "MATH", "SDPA's choice"),  # the CPU's flash kernel takes no dropout
    ({"ts_attention_backend": "math"}, "MATH", "forced by --ts-attention-backend math"),
])
def test_one_log_line_names_the_kernel_that_runs(caplog, overrides, kernel, how):
    model = build(**overrides).train()
    tokens = torch.randint(4, 40, (2, 16))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _, _, ops = step(model, tokens)
        step(model, tokens)
    lines = [r.getMessage() for r in caplog.records if "attention kernel" in r.getMessage()]
    assert lines == [f"attention kernel of TransformerDecoder on cpu float32: {kernel} ({how}"
                     + ("; force one with --ts-attention-backend)" if "choice" in how else ")")]
    assert ops == {KERNEL_OPS[kernel]}


def test_refusals():
    with pytest.raises(TsConfigError, match="is not an SDPA kernel"):
        MultiheadAttention(16, 2, backend="fast")
    with pytest.raises(TsConfigError, match="cudnn is a CUDA kernel and this run is on the CPU"):
        build(ts_attention_backend="cudnn")
