"""Split experts through the fairseq console tools (gloo): a Magneto X-MoE ``ts_lm`` with
SparseClip (top-2, ``random`` second expert, capacity dropping, dropout 0)

- at ``--model-parallel-size 2`` with split experts (the default) trains like the single
  process: per-update loss, ``gnorm``, ``gnorm_dense`` and ``gnorm_expert`` within 1e-4
  relative;
- each checkpoint part holds half of every split expert tensor (the ``fc2`` bias whole);
- ``ts-reshard`` of the parts to size 1 gives the single-process shapes, and
  ``fairseq-eval-lm`` scores the resharded file like the parts at size 2.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.helpers.mp_helpers import make_corpora, relative_close, run_jobs, train_records
from torchscale_fairseq.cli import reshard

UPDATES = 6
REL = 1e-4
EXPERTS, DIM, FFN = 4, 32, 64


def lm_args(data: Path, save: Path, tp: int) -> list[str]:
    return [str(data), "--task", "language_modeling", "--arch", "ts_lm_tiny", "--decoder-layers", "2",
            "--decoder-embed-dim", str(DIM), "--decoder-ffn-embed-dim", str(FFN), "--decoder-attention-heads", "4",
            "--tokens-per-sample", "32", "--batch-size", "4", "--max-update", str(UPDATES), "--save-dir", str(save),
            "--model-parallel-size", str(tp), "--moe-expert-count", str(EXPERTS), "--moe-freq", "2",
            "--criterion", "moe_cross_entropy", "--optimizer", "sparse_clip", "--sparse-clip-base", "adam",
            "--lr", "1e-3", "--clip-norm", "0.5", "--dropout", "0", "--log-format", "json", "--log-interval", "1",
            "--no-epoch-checkpoints", "--disable-validation", "--ddp-backend", "legacy_ddp", "--seed", "3"]


def eval_args(data: Path, path: Path) -> list[str]:
    return [str(data), "--path", str(path), "--task", "language_modeling", "--tokens-per-sample", "32",
            "--batch-size", "4", "--gen-subset", "valid"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Both trainings at once; reshard in this process; both evaluations at once."""
    root = tmp_path_factory.mktemp("split_experts")
    lm_bin, _ = make_corpora(root)
    logs, _ = run_jobs({name: ("fairseq-train", lm_args(lm_bin, root / name, tp), tp) for name, tp in
                        (("tp1", 1), ("tp2", 2))}, root, unrounded=True)
    parts, one = root / "tp2" / "checkpoint_last.pt", root / "one" / "checkpoint.pt"
    reshard.main(["--input", str(parts), "--size", "1", "--output", str(one)])
    evaluations, _ = run_jobs({"eval2": ("fairseq-eval-lm", [*eval_args(lm_bin, parts), "--model-parallel-size", "2"],
                                         2),
                               "eval1": ("fairseq-eval-lm", eval_args(lm_bin, one), 1)}, root)
    logs.update(evaluations)
    return {"root": root, "logs": logs, "parts": parts, "one": one}


def test_split_experts_train_like_single_process(runs):
    r1, r2 = train_records(runs["logs"]["tp1"][0]), train_records(runs["logs"]["tp2"][0])
    assert len(r1) == len(r2) == UPDATES, (len(r1), len(r2))
    for step, (a, b) in enumerate(zip(r1, r2), start=1):
        for key in ("loss", "gnorm", "gnorm_dense", "gnorm_expert"):
            x, y = float(a[key]), float(b[key])
            assert relative_close(x, y, REL), f"update {step} {key}: {x} vs {y}"


def _state(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def test_each_part_holds_half_of_the_split_expert_tensors(runs):
    whole = _state(runs["root"] / "tp1" / "checkpoint_last.pt")["model"]
    parts = [_state(runs["parts"].with_name(f"checkpoint_last-model_part-{k}.pt")) for k in range(2)]
    experts = sorted(k for k in whole if ".experts." in k)
    assert experts and set(parts[0]["extra_state"]["ts_tensor_parallel"]["expert_parallel"]["tensors"]) == set(experts)
    layout = parts[0]["extra_state"]["ts_tensor_parallel"]["layout"]
    for key in experts:
        numel = [p["model"][key].numel() for p in parts]
        if key.endswith("fc2_bias"):
            assert key not in layout and numel == [whole[key].numel()] * 2, key
        else:
            assert key in layout and numel == [whole[key].numel() // 2] * 2, key
    # per rank: E (d f + f + f d + 2 f) / 2 + E d for each MoE layer (Magneto: Sub-LN affine per expert)
    per_rank = sum(parts[0]["model"][k].numel() for k in experts)
    assert per_rank == EXPERTS * ((DIM * FFN + FFN + FFN * DIM + 2 * FFN) // 2 + DIM)


def test_resharded_split_experts_score_like_the_parts(runs):
    whole = _state(runs["root"] / "tp1" / "checkpoint_last.pt")["model"]
    one = _state(runs["one"])["model"]
    assert {k: v.shape for k, v in one.items()} == {k: v.shape for k, v in whole.items()}
    pattern = re.compile(r"Loss \(base 2\): ([0-9.]+)")
    logs = runs["logs"]
    loss2, loss1 = (float(pattern.findall(log.read_text())[-1]) for log in (logs["eval2"][0], logs["eval1"][0]))
    assert abs(loss2 - loss1) <= 1e-4, (loss2, loss1)
