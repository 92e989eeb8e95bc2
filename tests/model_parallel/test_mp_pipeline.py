"""Pipeline parallelism through ``fairseq-train`` (one process per rank, gloo), against one
process with the same ``--update-freq`` (the pipeline's micro-batches), dropout 0:

- a 4-layer Magneto ``ts_lm`` at ``--pipeline-model-parallel-size 2`` under 1F1B, GPipe (with an
  uneven ``--pipeline-layers 1,3`` split) and interleaved 1F1B (2 virtual stages per rank):
  every update's loss and ``gnorm`` and every validation loss equal one process (1e-5 relative),
  so the three schedules agree; the interleaved run with ``--checkpoint-activations selective``;
- tied input/output embeddings at P = 4 (the embedding on the first stage, its copy on the last,
  their gradients summed over the embedding group; the norm counts the embedding once);
- P = 2 x TP = 2 (tied), and P = 2 x TP = 2 with ``--sequence-parallel`` and full
  ``--checkpoint-activations``, on 4 ranks;
- an X-MoE LM with SparseClip and the z-loss, interleaved (an MoE layer on a stage before the
  last: its auxiliary losses differentiated there, its figures logged with the last stage's), and
  at P = 2 x DP = 2 with the experts spread over the data-parallel ranks and ``--zero-sharding os``
  against one process
  accumulating both pipelines' batches (``--update-freq 8``): also the balance and z-losses, the
  load CVs, the drop fraction and SparseClip's dense and expert norms;
- what a pipelined run cannot honour is a one-line error on every rank before any step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mp_helpers import make_corpora, relative_close, run_jobs, train_records

UPDATES = 4
REL = 1e-5
COMMON = ["--optimizer", "adam", "--lr", "1e-3", "--clip-norm", "0.5", "--dropout", "0", "--log-format", "json",
          "--log-interval", "1", "--no-save", "--ddp-backend", "legacy_ddp", "--seed", "3",
          "--validate-interval-updates", "2", "--max-valid-steps", "4"]


def lm_args(data: Path, update_freq: int, *extra: str) -> list[str]:
    return [str(data), "--task", "language_modeling", "--arch", "ts_lm_tiny", "--decoder-layers", "4",
            "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4",
            "--tokens-per-sample", "32", "--batch-size", "4", "--max-update", str(UPDATES),
            "--update-freq", str(update_freq), *COMMON, *extra]


PP2 = ("--pipeline-model-parallel-size", "2")
TIED = ("--share-decoder-input-output-embed",)
# X-MoE (Magneto's default backbone, xmoe router) in layers 2 and 4 with SparseClip and the z-loss;
# "all" keeps both experts of every token, so routing draws nothing that update-freq would advance
MOE = ("--moe-expert-count", "4", "--moe-freq", "2", "--moe-second-expert-policy", "all", "--optimizer", "sparse_clip",
       "--sparse-clip-base", "adam", "--moe-z-loss-wt", "0.001", "--criterion", "moe_cross_entropy")
MOE_KEYS = ("moe_gate_loss", "moe_z_loss", "moe_cv_dec1", "moe_cv_dec3", "moe_drop", "gnorm_dense", "gnorm_expert")
RUNS = {  # name: (update-freq, world, flags, reference)
    "one": (4, 1, (), None),
    "one_tied": (4, 1, TIED, None),
    "moe_one": (4, 1, MOE, None),
    "moe_one_uf8": (8, 1, MOE, None),
    "pp2_1f1b": (4, 2, PP2, "one"),
    "pp2_gpipe_uneven": (4, 2, (*PP2, "--pipeline-schedule", "gpipe", "--pipeline-layers", "1,3"), "one"),
    "pp2_interleaved": (4, 2, (*PP2, "--virtual-pipeline-stages", "2", "--checkpoint-activations", "selective"), "one"),
    "pp4_tied": (4, 4, ("--pipeline-model-parallel-size", "4", *TIED), "one_tied"),
    "pp2_tp2_tied": (4, 4, (*PP2, "--model-parallel-size", "2", *TIED), "one_tied"),
    "pp2_tp2_sp": (4, 4, (*PP2, "--model-parallel-size", "2", "--sequence-parallel", "--checkpoint-activations"), "one"),
    "moe_pp2_interleaved": (4, 2, (*PP2, "--virtual-pipeline-stages", "2", *MOE), "moe_one"),
    "moe_pp2_dp2": (4, 4, (*PP2, *MOE, "--zero-sharding", "os"), "moe_one_uf8"),
}
ERRORS = {  # name: (world, flags, expected error)
    "pipeline_larger_than_world": (2, ("--pipeline-model-parallel-size", "3"), "pipeline-parallel size 3 does not divide"),
    "uneven_without_split": (2, (*PP2, "--decoder-layers", "3"), "do not split evenly into 2 pipeline stage(s)"),
    "bad_split": (2, (*PP2, "--pipeline-layers", "2,1"), "at least one layer each, 4 layers in all"),
    "update_freq_below_stages": (2, (*PP2, "--update-freq", "1"), "fewer micro-batches than the 2 pipeline stages"),
    "interleaved_update_freq": (2, (*PP2, "--virtual-pipeline-stages", "2", "--update-freq", "3"),
                                "use an --update-freq that is a multiple of it"),
    "c10d_with_data_parallel": (4, (*PP2, "--ddp-backend", "c10d"), "use --ddp-backend legacy_ddp"),
    "checkpoints": (2, (*PP2, "--save-dir", "SAVE"), "does not save checkpoints yet"),
    "rel_pos": (2, (*PP2, "--rel-pos-buckets", "32"), "--rel-pos-buckets is not pipeline-parallel yet"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pp")
    lm_bin, _ = make_corpora(root)
    jobs = {name: ("fairseq-train", lm_args(lm_bin, update_freq, *flags), world)
            for name, (update_freq, world, flags, _) in RUNS.items()}
    for name, (world, flags, _) in ERRORS.items():
        args = lm_args(lm_bin, 4, *flags)
        if "--save-dir" in args:
            args = [a for a in args if a != "--no-save"]
            args[args.index("SAVE")] = str(root / "save")
        jobs[name] = ("fairseq-train", args, world)
    logs, codes = run_jobs(jobs, root, unrounded=True, must_fail=list(ERRORS))
    return {"logs": logs, "codes": codes, "root": root}


def _valid_losses(log: Path) -> list[float]:
    return [float(line[line.index("{"):].split('"valid_loss": "')[1].split('"')[0])
            for line in log.read_text().splitlines() if "valid_loss" in line and "{" in line]


@pytest.mark.parametrize("name", [n for n, spec in RUNS.items() if spec[3] is not None])
def test_pipeline_equals_one_process(runs, name):
    reference = runs["logs"][RUNS[name][3]][0]
    ours, theirs = train_records(runs["logs"][name][0]), train_records(reference)
    assert len(ours) == len(theirs) == UPDATES
    for update, (a, b) in enumerate(zip(ours, theirs), start=1):
        for key in ("loss", "gnorm", *(MOE_KEYS if name.startswith("moe") else ())):
            assert relative_close(float(a[key]), float(b[key]), REL), f"update {update} {key}: {a[key]} vs {b[key]}"
    valid, valid_ref = _valid_losses(runs["logs"][name][0]), _valid_losses(reference)
    assert len(valid) == len(valid_ref) == UPDATES // 2
    assert all(relative_close(a, b, REL) for a, b in zip(valid, valid_ref)), (valid, valid_ref)


@pytest.mark.parametrize("name", list(ERRORS))
def test_pipeline_bad_inputs_are_one_line_errors(runs, name):
    expected = ERRORS[name][2]
    for log in runs["logs"][name]:
        text = log.read_text()
        lines = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
        assert expected in lines[-1] and "Traceback" not in text, text[-2000:]
    assert not (runs["root"] / "save").exists() or not any((runs["root"] / "save").iterdir())
