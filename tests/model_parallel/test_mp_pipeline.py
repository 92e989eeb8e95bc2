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
- a 4-layer ``ts_mlm`` (``masked_lm``; the encoder split, the BERT head and the embedding's copy
  on the last stage) at P = 2, and at P = 2 x TP = 2 with ``--sequence-parallel``;
- what a pipelined run cannot honour is a one-line error on every rank before any step (one run
  per place that checks; the other checks called in this process).

Checkpoints (each stage its own ``-stage<p>`` file, layers named by global index), against the
one-process runs' own checkpoints and logs:

- ``ts-reshard --pipeline-size 1`` of the P = 4 (tied) checkpoint: ``fairseq-eval-lm`` on it equals
  the pipelined run's last validation loss, and one process resumed from its update-2 checkpoint
  makes the one-process run's updates 3 and 4 (the Adam moments came along); the same resume
  from the ``ts_mlm`` P = 2 run's;
- the merged interleaved (V = 2), P = 2 x DP = 2 X-MoE (experts consolidated) and ``ts_mlm`` P = 2
  checkpoints (stages merged, as ``ts-export-hf`` reads them) hold the one-process run's weights;
- P = 2, V = 2 -> 1 -> P = 2, V = 2 gives back every file bitwise (weights, moments, record);
- P = 2 x TP = 2 with dropout on: replicated tensors stay bitwise equal across the parts of a
  stage, the tied embedding's copy across the stages;
- ``fairseq-eval-lm`` given the stages is a one-line error naming the conversion.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.mp_helpers import assert_replicated_across_parts, make_corpora, relative_close, run_jobs, train_records
from torchscale_fairseq.cli import consolidate_experts, reshard
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.pipeline_step import check_pipeline_run
from torchscale_fairseq.interop.checkpoint_files import load_single_process_state
from torchscale_fairseq.model_parallel.pipeline_parallel import stage_layer_counts

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


def mlm_args(data: Path, update_freq: int, *extra: str) -> list[str]:
    return [str(data), "--task", "masked_lm", "--criterion", "masked_lm", "--arch", "ts_mlm_tiny", "--encoder-layers",
            "4", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4",
            "--tokens-per-sample", "32", "--sample-break-mode", "none", "--batch-size", "4", "--max-update",
            str(UPDATES), "--update-freq", str(update_freq), *COMMON, *extra]


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
    "pp2_tp2_dropout": (4, 4, (*PP2, "--model-parallel-size", "2", *TIED, "--dropout", "0.1", "--attention-dropout",
                               "0.1"), None),
    "moe_pp2_interleaved": (4, 2, (*PP2, "--virtual-pipeline-stages", "2", *MOE), "moe_one"),
    "moe_pp2_dp2": (4, 4, (*PP2, *MOE, "--zero-sharding", "os"), "moe_one_uf8"),
    "mlm_one": (4, 1, (), None),  # (names starting with mlm_: ts_mlm, mlm_args)
    "mlm_pp2": (4, 2, PP2, "mlm_one"),
    "mlm_pp2_tp2_sp": (4, 4, (*PP2, "--model-parallel-size", "2", "--sequence-parallel"), "mlm_one"),
}
ERRORS = {  # name: (world, flags, expected error); one through fairseq-train per place that checks
    "pipeline_larger_than_world": (2, ("--pipeline-model-parallel-size", "3"), "pipeline-parallel size 3 does not divide"),
    "bad_split": (2, (*PP2, "--pipeline-layers", "2,1"), "at least one layer each, 4 layers in all"),
    "update_freq_below_stages": (2, (*PP2, "--update-freq", "1"), "fewer micro-batches than the 2 pipeline stages"),
    "rel_pos": (2, (*PP2, "--rel-pos-buckets", "32"), "--rel-pos-buckets is not pipeline-parallel yet"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pp")
    lm_bin, _ = make_corpora(root)
    jobs = {name: ("fairseq-train", (mlm_args if name.startswith("mlm_") else lm_args)(lm_bin, update_freq, *flags),
                   world)
            for name, (update_freq, world, flags, _) in RUNS.items()}
    for name in SAVED:
        args = jobs[name][1]
        args[args.index("--no-save"):args.index("--no-save") + 1] = [
            "--save-dir", str(root / name), "--save-interval-updates", "2"]
    for name, (world, flags, _) in ERRORS.items():
        jobs[name] = ("fairseq-train", [*lm_args(lm_bin, 4, *flags), "--save-dir", str(root / "save")], world)
    logs, codes = run_jobs(jobs, root, unrounded=True, must_fail=list(ERRORS))
    return {"logs": logs, "codes": codes, "root": root, "lm_bin": lm_bin}


SAVED = ("one_tied", "pp4_tied", "one", "pp2_interleaved", "moe_one_uf8", "moe_pp2_dp2", "pp2_tp2_dropout", "mlm_one",
         "mlm_pp2")


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


def _pipeline_cfg(update_freq: int, virtual_stages: int = 1, backend: str = "legacy_ddp") -> SimpleNamespace:
    """The fields of fairseq's config that :func:`check_pipeline_run` reads."""
    return SimpleNamespace(distributed_training=SimpleNamespace(ddp_backend=backend), ema=SimpleNamespace(store_ema=False),
                           model=SimpleNamespace(virtual_pipeline_stages=virtual_stages, pipeline_schedule="1f1b"),
                           optimization=SimpleNamespace(update_freq=[update_freq]))


@pytest.mark.parametrize("check, expected", [
    (lambda: stage_layer_counts(3, 2), "do not split evenly into 2 pipeline stage(s)"),
    (lambda: check_pipeline_run(_pipeline_cfg(3, virtual_stages=2), 1, 2),
     "use an --update-freq that is a multiple of it"),
    (lambda: check_pipeline_run(_pipeline_cfg(4, backend="c10d"), 2, 2), "use --ddp-backend legacy_ddp"),
])
def test_pipeline_bad_inputs_checked_in_process_are_one_line_errors(check, expected):
    """The checks of ``test_pipeline_bad_inputs_are_one_line_errors``'s runs (the model split at
    ``--decoder-layers 3``; the trainer's, on an interleaved and a data-parallel pipeline),
    called as fairseq-train calls them."""
    with pytest.raises(TsConfigError) as error:
        check()
    assert expected in str(error.value) and "\n" not in str(error.value)


# checkpoints ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(runs, tmp_path_factory) -> dict:
    """The P = 4 checkpoints merged (``ts-reshard``), then at once: fairseq-eval-lm on the merged
    last checkpoint and on the stages, one process resumed from the merged update-2 checkpoint (and
    from the ts_mlm P = 2 run's)."""
    root, out = runs["root"], tmp_path_factory.mktemp("pp_converted")
    for name in ("checkpoint_1_2", "checkpoint_last"):
        reshard.main(["--input", str(root / "pp4_tied" / f"{name}.pt"), "--pipeline-size", "1",
                      "--output", str(out / f"{name}.pt")])
    reshard.main(["--input", str(root / "mlm_pp2" / "checkpoint_1_2.pt"), "--pipeline-size", "1",
                  "--output", str(out / "mlm_1_2.pt")])
    resume_args = lm_args(runs["lm_bin"], 4, *TIED)
    evaluate = [str(runs["lm_bin"]), "--task", "language_modeling", "--tokens-per-sample", "32", "--batch-size", "4",
                "--gen-subset", "valid", "--path"]
    logs, _ = run_jobs({
        "eval_merged": ("fairseq-eval-lm", [*evaluate, str(out / "checkpoint_last.pt")], 1),
        "eval_stages": ("fairseq-eval-lm", [*evaluate, str(root / "pp4_tied" / "checkpoint_last.pt")], 1),
    }, out, must_fail=["eval_stages"])
    resumed, _ = run_jobs({
        "resumed": ("fairseq-train", [*resume_args, "--restore-file", str(out / "checkpoint_1_2.pt")], 1),
        "mlm_resumed": ("fairseq-train", [*mlm_args(runs["lm_bin"], 4), "--restore-file", str(out / "mlm_1_2.pt")], 1),
    }, out, unrounded=True)
    return {"logs": {**logs, **resumed}, "out": out}


def test_eval_lm_on_the_merged_stages_equals_the_pipelined_validation(runs, converted):
    text = converted["logs"]["eval_merged"][0].read_text()
    loss = float(text.split("Loss (base 2): ")[1].split(",")[0])
    assert relative_close(loss, _valid_losses(runs["logs"]["pp4_tied"][0])[-1], 1e-4), loss


@pytest.mark.parametrize("resumed,reference", [("resumed", "one_tied"), ("mlm_resumed", "mlm_one")])
def test_one_process_resumes_the_merged_stages_like_one_process(runs, converted, resumed, reference):
    """ts_lm P = 4 (tied) and ts_mlm P = 2 (its head's bias first in one process's parameter order):
    the merged update-2 checkpoint's weights and Adam moments make one process's updates 3 and 4."""
    text = converted["logs"][resumed][0].read_text()
    assert "Loaded checkpoint" in text and "@ 2 updates" in text
    ours, theirs = train_records(converted["logs"][resumed][0]), train_records(runs["logs"][reference][0])[2:]
    assert [r["num_updates"] for r in ours] == ["3", "4"]
    for a, b in zip(ours, theirs):
        for key in ("loss", "gnorm"):
            assert relative_close(float(a[key]), float(b[key]), REL), (key, a[key], b[key])


def test_eval_lm_on_the_stages_is_one_line(converted):
    lines = [ln for ln in converted["logs"]["eval_stages"][0].read_text().splitlines() if ln.strip()]
    assert "was saved as 4 pipeline stages" in lines[-1] and "--pipeline-size 1" in lines[-1], lines[-3:]


@pytest.mark.parametrize("name,reference", [("pp4_tied", "one_tied"), ("pp2_interleaved", "one"),
                                            ("moe_pp2_dp2", "moe_one_uf8"), ("mlm_pp2", "mlm_one")])
def test_merged_stages_hold_the_one_process_weights(runs, name, reference):
    merged = load_single_process_state(str(runs["root"] / name / "checkpoint_last.pt"))["model"]
    want = load_single_process_state(str(runs["root"] / reference / "checkpoint_last.pt"))["model"]
    assert list(merged) == list(want)
    for key, value in want.items():
        assert torch.allclose(merged[key], value, rtol=1e-4, atol=1e-5), key


def test_dropout_keeps_tensor_parallel_replicas_and_tied_copies_bitwise_equal(runs):
    """P = 2 x TP = 2 with dropout on, 4 updates: in each stage every tensor the attribute registry
    does not mark as split (and its Adam moments) is bitwise equal in both parts, and in each part
    the last stage's copy of the tied embedding equals the first stage's embedding."""
    save = runs["root"] / "pp2_tp2_dropout"
    for stage in (0, 1):
        replicated = assert_replicated_across_parts(
            [save / f"checkpoint_last-model_part-{k}-stage{stage}.pt" for k in (0, 1)])
        assert any(key.endswith("fc2.bias") for key in replicated), replicated
    for part in (0, 1):
        first, last = (torch.load(save / f"checkpoint_last-model_part-{part}-stage{p}.pt", weights_only=True)["model"]
                       for p in (0, 1))
        assert torch.equal(first["decoder.embed.embed_tokens.weight"], last["decoder.tied_output.weight"])


def test_stages_round_trip_through_one_stack_bitwise(runs, tmp_path):
    source = runs["root"] / "pp2_interleaved" / "checkpoint_last.pt"
    reshard.main(["--input", str(source), "--pipeline-size", "1", "--output", str(tmp_path / "one.pt")])
    reshard.main(["--input", str(tmp_path / "one.pt"), "--pipeline-size", "2", "--virtual-pipeline-stages", "2",
                  "--output", str(tmp_path / "back.pt")])
    for stage in (0, 1):
        a = torch.load(source.with_name(f"checkpoint_last-stage{stage}.pt"), weights_only=True)
        b = torch.load(tmp_path / f"back-stage{stage}.pt", weights_only=True)
        assert list(a["model"]) == list(b["model"]) and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        for field in ("params", "layout", "pipeline", "expert_parallel"):
            assert a["extra_state"]["ts_tensor_parallel"][field] == b["extra_state"]["ts_tensor_parallel"][field], field
        moments_a, moments_b = a["last_optimizer_state"], b["last_optimizer_state"]
        assert moments_a["param_groups"] == moments_b["param_groups"]
        assert moments_a["state"].keys() == moments_b["state"].keys()
        for index, entry in moments_a["state"].items():
            for key, value in entry.items():
                other = moments_b["state"][index][key]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (index, key)


def test_expert_shards_of_stages_consolidate_per_stage(runs, tmp_path):
    consolidate_experts.main([str(runs["root"] / "moe_pp2_dp2" / "checkpoint_last.pt"), "-o", str(tmp_path / "c.pt")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c-stage0.pt", "c-stage1.pt"]
    merged = load_single_process_state(str(tmp_path / "c.pt"))["model"]
    want = load_single_process_state(str(runs["root"] / "moe_pp2_dp2" / "checkpoint_last.pt"))["model"]
    assert list(merged) == list(want) and all(torch.equal(merged[k], want[k]) for k in want)
