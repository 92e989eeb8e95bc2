"""``fairseq-train ts_lm`` under ``--context-parallel-size`` (one process per rank, gloo, CPU):
the per-update loss and gradient norm and the validation loss of C = 2, of C = 2 x TP = 2, of
C = 2 x TP = 2 with ``--sequence-parallel`` and selective recomputation, and of C = 2 x DP = 2
with ``--zero-sharding os``, whole-layer recomputation and learned positions, of C = 2 with
``--zero-sharding full`` (FSDP2 shards over the data x context ranks), and of C = 2 x
PP = 2 (the stages' messages are each rank's two chunks, ``(B, T / C, E)``; the first stage
embeds them at their global positions), equal the single-process run (C = 2 x DP = 2 against
one process summing the same two batches per update, ``--update-freq 2``) within the
tensor-parallel tests' 1e-4 relative. The last block of the corpus is shorter than
``--tokens-per-sample``: it is padded to the ``2 C`` chunks. The flag in a single process, and
C = 2 x PP = 2 with DDP's hooks (``--ddp-backend c10d``: the context ranks average gradients, inside
backwards the pipeline runs out of order), and ``--sentence-avg`` under CP (each rank would count
every sentence), are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.mp_helpers import BIN, USER_DIR, launch, make_corpora, relative_close, run_jobs, train_records

UPDATES = 8
REL = 1e-4
COMMON = ["--optimizer", "adam", "--lr", "1e-3", "--clip-norm", "0.5", "--dropout", "0", "--log-format", "json",
          "--log-interval", "1", "--no-epoch-checkpoints", "--no-save", "--seed", "3", "--max-update", str(UPDATES),
          "--validate-interval-updates", "4", "--task", "language_modeling", "--arch", "ts_lm_tiny",
          "--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128",
          "--decoder-attention-heads", "4", "--tokens-per-sample", "32", "--batch-size", "4"]


def lm_args(data: Path, *extra: str, update_freq: int = 2) -> list[str]:
    return [str(data), *COMMON, "--update-freq", str(update_freq), *extra]


def valid_losses(log: Path) -> list[float]:
    return [float(json.loads(line[line.index("{"):])["valid_loss"]) for line in log.read_text().splitlines()
            if "valid_loss" in line and "{" in line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cp")
    lm_bin, _ = make_corpora(root)
    learned = ("--decoder-learned-pos",)
    jobs = {
        "c1": (lm_args(lm_bin), 1),
        "c1_learned": (lm_args(lm_bin, *learned), 1),
        "c2": (lm_args(lm_bin, "--context-parallel-size", "2"), 2),
        "c2tp2": (lm_args(lm_bin, "--context-parallel-size", "2", "--model-parallel-size", "2"), 4),
        "c2tp2sp": (lm_args(lm_bin, "--context-parallel-size", "2", "--model-parallel-size", "2", "--sequence-parallel",
                            "--checkpoint-activations", "selective"), 4),
        "c2pp2": (lm_args(lm_bin, "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--ddp-backend", "legacy_ddp"), 4),
        "c2dp2": (lm_args(lm_bin, *learned, "--context-parallel-size", "2", "--zero-sharding", "os",
                          "--checkpoint-activations", update_freq=1), 4),
        "c2full": (lm_args(lm_bin, "--context-parallel-size", "2", "--zero-sharding", "full"), 2),
    }
    jobs["c2pp2_c10d"] = (lm_args(lm_bin, "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                  "--ddp-backend", "c10d"), 4)
    jobs["c2_sentence_avg"] = (lm_args(lm_bin, "--context-parallel-size", "2", "--sentence-avg"), 2)
    logs, _ = run_jobs({name: ("fairseq-train", args, world) for name, (args, world) in jobs.items()}, root,
                       unrounded=True, must_fail=["c2pp2_c10d", "c2_sentence_avg"])
    return {"root": root, "lm_bin": lm_bin, "logs": {name: files[0] for name, files in logs.items()}}


@pytest.mark.parametrize("run,reference", [("c2", "c1"), ("c2tp2", "c1"), ("c2tp2sp", "c1"),
                                           ("c2pp2", "c1"), ("c2dp2", "c1_learned"), ("c2full", "c1")])
def test_context_parallel_equals_single_process(runs, run, reference):
    ours, theirs = train_records(runs["logs"][run]), train_records(runs["logs"][reference])
    assert len(ours) == len(theirs) == UPDATES
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        for key in ("loss", "gnorm", "wpb", "bsz"):
            assert relative_close(float(a[key]), float(b[key]), REL), f"update {step} {key}: {a[key]} vs {b[key]}"
    ours_valid, theirs_valid = valid_losses(runs["logs"][run]), valid_losses(runs["logs"][reference])
    assert len(ours_valid) == len(theirs_valid) == 2
    for a, b in zip(ours_valid, theirs_valid):
        assert relative_close(a, b, REL), (a, b)


def test_flag_without_processes_is_one_line(runs, tmp_path):
    log = tmp_path / "train.log"
    code = launch([str(BIN / "fairseq-train"), *lm_args(runs["lm_bin"], "--context-parallel-size", "2"),
                   "--save-dir", str(tmp_path / "checkpoints"), "--user-dir", str(USER_DIR), "--cpu"], log).wait(timeout=300)
    assert code != 0
    assert "--context-parallel-size 2 needs a multi-process run of a multiple of 2 ranks (this one has 1)" in log.read_text()


def test_pipeline_with_ddp_hooks_is_one_line(runs):
    text = runs["logs"]["c2pp2_c10d"].read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    assert ("--ddp-backend c10d all-reduces inside every backward, which a pipeline runs out of order: use "
            "--ddp-backend legacy_ddp") in lines[-1] and "Traceback" not in text, text[-2000:]


def test_sentence_avg_is_one_line(runs):
    text = runs["logs"]["c2_sentence_avg"].read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    assert "--sentence-avg would count every sentence on each: drop --sentence-avg" in lines[-1], text[-2000:]
