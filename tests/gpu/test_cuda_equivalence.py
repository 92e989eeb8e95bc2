"""CUDA computes what the CPU computes: the fp32 forward of every model x backbone
(relative error < 1e-4), and ``fairseq-generate``'s beam search on a tiny trained model
(the same hypotheses)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.cli_utils import MT_TRAIN, USER_DIR, run, run_many, tool
from tests.helpers.model_utils import build, dictionary

pytestmark = pytest.mark.gpu

BACKBONES = ("magneto", "deepnorm", "preln", "postln")


def forward(kind: str, model, tokens: torch.Tensor) -> torch.Tensor:
    if kind == "mt":
        return model(tokens, torch.full((tokens.size(0),), tokens.size(1)), tokens.flip(1))[0]
    return model(tokens)[0]


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("kind", ["lm", "mt", "mlm"])
def test_cuda_forward_equals_cpu(kind, backbone):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products, as on the CPU
    d = dictionary()
    torch.manual_seed(0)
    model = build(kind, d, backbone=backbone).eval()
    tokens = torch.randint(d.nspecial, len(d), (3, 24), generator=torch.Generator().manual_seed(1))
    tokens[0, :5] = d.pad()  # left padding in one row
    with torch.no_grad():
        expected = forward(kind, model, tokens)
        got = forward(kind, model.cuda(), tokens.cuda()).cpu()
    assert got.dtype == expected.dtype == torch.float32
    rel = float((got - expected).norm() / expected.norm())
    assert rel < 1e-4, f"{kind} {backbone}: relative error {rel:.2e}"


_HYPOTHESIS = re.compile(r"^H-(\d+)\t(\S+)\t(.*)$", re.M)


def test_generate_on_cuda_equals_cpu(tmp_path, mt_data):
    save = tmp_path / "ck"
    run([tool("fairseq-train"), mt_data, "--user-dir", USER_DIR, "--arch", "ts_transformer_tiny", *MT_TRAIN,
         "--max-update", "40", "--save-dir", save, "--dropout", "0.0", "--disable-validation"])
    generate = [tool("fairseq-generate"), mt_data, "--user-dir", USER_DIR, "--path", save / "checkpoint_last.pt",
                "--gen-subset", "test", "--beam", "5", "--batch-size", "8", "--max-len-b", "30"]
    cpu, cuda = run_many([[*generate, "--cpu"], generate])
    expected = {i: (float(s), h) for i, s, h in _HYPOTHESIS.findall(cpu.stdout)}
    got = {i: (float(s), h) for i, s, h in _HYPOTHESIS.findall(cuda.stdout)}
    assert len(expected) == 40 and got.keys() == expected.keys()
    assert {i: h for i, (_, h) in got.items()} == {i: h for i, (_, h) in expected.items()}
    for i, (score, _) in got.items():
        assert score == pytest.approx(expected[i][0], abs=1e-3), i
