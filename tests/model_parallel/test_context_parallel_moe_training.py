"""``fairseq-train`` of an X-MoE ``ts_lm`` under ``--context-parallel-size`` (one process per rank,
gloo, CPU), against runs without it: every rank routes its own chunks, the routing statistics sum
over the context-parallel group and the experts spread over the data-parallel x context-parallel
ranks, so each update's loss, gradient norm, batch size (``bsz``, sentences counted once per
context-parallel group), ``moe_gate_loss``, ``moe_z_loss``, load CVs, drop and routing entropy,
and the validation loss equal those of ``C = 1`` within 1e-4 relative:

- C = 2 (experts over the context-parallel pair, local balance scope) against one process
  summing the same two batches per update (``--update-freq 2``);
- C = 2 x DP = 2 (4 experts over all 4 ranks, global balance scope, whole-layer recomputation)
  against DP = 2 (experts over the 2 data-parallel ranks).

Routing equals ``C = 1``'s token by token only without capacity dropping (``--moe-capacity-factor
0``; the capacity counts each rank's tokens, as Megatron-core's) and with a deterministic second
expert (``--moe-second-expert-policy all``). The corpus's last block is shorter than
``--tokens-per-sample``: its pads are not routed, and the ring attends without a mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.mp_helpers import make_corpora, relative_close, run_jobs, train_records

UPDATES = 6
REL = 1e-4
MOE = ["--optimizer", "adam", "--lr", "1e-3", "--clip-norm", "0.5", "--dropout", "0", "--log-format", "json",
       "--log-interval", "1", "--no-epoch-checkpoints", "--no-save", "--seed", "3", "--max-update", str(UPDATES),
       "--validate-interval-updates", "3", "--task", "language_modeling", "--arch", "ts_lm_tiny",
       "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
       "--decoder-attention-heads", "4", "--tokens-per-sample", "32", "--batch-size", "4",
       "--moe-expert-count", "4", "--moe-freq", "2", "--moe-top-k", "2", "--moe-second-expert-policy", "all",
       "--moe-capacity-factor", "0", "--criterion", "moe_cross_entropy", "--moe-gate-loss-wt", "0.1",
       "--moe-z-loss-wt", "0.01"]
FIGURES = ("loss", "gnorm", "wpb", "bsz", "moe_gate_loss", "moe_z_loss", "moe_drop", "moe_entropy")


def lm_args(data: Path, *extra: str, update_freq: int) -> list[str]:
    return [str(data), *MOE, "--update-freq", str(update_freq), *extra]


def valid_records(log: Path) -> list[dict]:
    return [json.loads(line[line.index("{"):]) for line in log.read_text().splitlines()
            if "valid_loss" in line and "{" in line]


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cp_moe")
    lm_bin, _ = make_corpora(root)
    cp, global_scope = ("--context-parallel-size", "2"), ("--moe-balance-scope", "global")
    jobs = {
        "c1": (lm_args(lm_bin, update_freq=2), 1),
        "c2": (lm_args(lm_bin, *cp, update_freq=2), 2),
        "dp2": (lm_args(lm_bin, *global_scope, update_freq=1), 2),
        "c2dp2": (lm_args(lm_bin, *cp, *global_scope, "--checkpoint-activations", update_freq=1), 4),
    }
    ran, _ = run_jobs({name: ("fairseq-train", args, world) for name, (args, world) in jobs.items()}, root,
                      unrounded=True)
    return {name: files[0] for name, files in ran.items()}


@pytest.mark.parametrize("run,reference", [("c2", "c1"), ("c2dp2", "dp2")])
def test_context_parallel_moe_equals_c1(logs, run, reference):
    ours, theirs = train_records(logs[run]), train_records(logs[reference])
    assert len(ours) == len(theirs) == UPDATES
    cvs = sorted(k for k in theirs[0] if k.startswith("moe_cv_"))
    assert cvs and sorted(k for k in ours[0] if k.startswith("moe_cv_")) == cvs
    assert float(theirs[0]["moe_z_loss"]) > 0 and float(theirs[0]["moe_entropy"]) > 0
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        for key in (*FIGURES, *cvs):
            assert relative_close(float(a[key]), float(b[key]), REL), f"update {step} {key}: {a[key]} vs {b[key]}"
    ours_valid, theirs_valid = valid_records(logs[run]), valid_records(logs[reference])
    assert len(ours_valid) == len(theirs_valid) == 2
    for a, b in zip(ours_valid, theirs_valid):
        for key in ("valid_loss", "valid_bsz", *(f"valid_{k}" for k in (*FIGURES[4:], *cvs))):
            assert relative_close(float(a[key]), float(b[key]), REL), (key, a[key], b[key])
