"""Every scripts/{lm,nmt}/*.sh recipe at SCALE=tiny on tiny data (3 updates), then its evaluate.sh: the
dense LM with DeepNorm over 2 ranks at ZERO=full (FSDP2), the MoE LM at MP=2 (tensor parallel, gloo;
experts replicated over the two parts; CLIP=vanilla), the dense LM at PP=2 (two pipeline stages;
evaluate.sh merges them), the long-context LM at its tiny CP=2 x MP=2 (context parallelism,
--sequence-parallel, selective recomputation), the dense Post-LN NMT at MP=2, and the MoE NMT
(CLIP=sparse, one process) as scripts/demo.sh runs it at toy size on the same data beside its
adaptive-softmax LM (its baselines against sacrebleu and the formula); then ts-plot-logs on the logs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch

from data_prep import prepare_lm, prepare_nmt, unigram_ppl
from tests.data_prep.test_prepare_nmt import EN, ES
from torchscale_fairseq.cli import plot_logs

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
# Each knob of the recipes rides on one run (the one-process MoE NMT recipe is the demo's, below).
TRAININGS = {
    "lm_long_context": ("lm/train_long_context.sh", {"CP": "2", "MP": "2"}),
    "lm_dense_full": ("lm/train_dense.sh", {"BACKBONE": "deepnorm", "LAYERS": "3", "ZERO": "full",
                                            "NPROC_PER_NODE": "2"}),
    "lm_moe_mp2": ("lm/train_moe.sh", {"EXPERTS": "4", "CLIP": "vanilla", "MP": "2"}),
    "nmt_dense_mp2": ("nmt/train_dense.sh", {"BACKBONE": "postln", "MP": "2"}),
    "lm_dense_pp2": ("lm/train_dense.sh", {"LAYERS": "4", "PP": "2"}),
}
RECIPES_AT_ONCE = 3  # processes: 5 (CP x MP and its torchrun) + 3 + 3 beside the demo's
DEMO_NMT = "nmt_moe"  # scripts/demo.sh's translation model: nmt/train_moe.sh (2 experts, SparseClip), nmt/evaluate.sh


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "VENV": str(VENV), "SCALE": "tiny", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module", autouse=True)
def torchrun_logs_in_a_pytest_folder(tmp_path_factory):
    """The recipes' torchrun (``scripts/common.sh``) keeps its log folders under pytest's temporary folders
    (``PET_LOG_DIR``: torchrun's ``--log-dir``), not in ``/tmp/torchelastic_*`` where they would stay."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PET_LOG_DIR", str(tmp_path_factory.mktemp("torchrun")))
        yield


def _steps(*steps: tuple[str, dict[str, str]]) -> list[subprocess.CompletedProcess]:
    """Run the scripts one after the other, up to the first that fails."""
    done = []
    for script, env in steps:
        done.append(subprocess.run(["bash", str(ROOT / "scripts" / script)], env=_env(**env), capture_output=True,
                                   text=True, timeout=900))
        if done[-1].returncode != 0:
            break
    return done


def _demo_env(root: Path) -> dict[str, str]:
    """scripts/demo.sh (adaptive-softmax LM, X-MoE NMT) on the tiny data, installed venv reused."""
    return dict(SKIP_INSTALL="1", DATA_DIR=str(root / "lm-bin"), SAVE_DIR=str(root / "demo_lm"), MAX_UPDATE="3",
                TOKENS_PER_SAMPLE="16", BATCH_SIZE="4", VALIDATE_INTERVAL="3", LOG_INTERVAL="1", SAMPLE_LEN="4",
                ARCH="ts_lm_tiny", NMT_DATA=str(root / "nmt-bin"), NMT_SAVE_DIR=str(root / DEMO_NMT),
                NMT_MAX_UPDATE="3", NMT_EXPERTS="2", NMT_EMBED_DIM="32", NMT_FFN_DIM="64", NMT_MAX_TOKENS="512",
                NMT_BEAM="1", PLOT_DIR=str(root / "demo_plots"))


def _prepare_lm(root: Path) -> None:
    docs = "\n\n".join(f"{EN[i]}\n{EN[i + 1]} {EN[i + 2]}" for i in range(0, 57, 3))
    (root / "lm.txt").write_text(docs + "\n", encoding="utf-8")
    prepare_lm.main(["--train-text", str(root / "lm.txt"), "--out-dir", str(root / "lm-bin"), "--workers", "1",
                     "--valid-fraction", "0.1", "--test-fraction", "0.1"])


def _prepare_nmt(root: Path) -> None:
    (root / "all.en").write_text("\n".join(EN) + "\n", encoding="utf-8")
    (root / "all.es").write_text("\n".join(ES) + "\n", encoding="utf-8")
    prepare_nmt.main(["--train-src", str(root / "all.en"), "--train-tgt", str(root / "all.es"), "--out-dir",
                      str(root / "nmt-bin"), "--valid-size", "5", "--test-size", "4", "--vocab-size", "120",
                      "--workers", "1"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny LM and NMT data prepared side by side, then the demo and the recipes (each evaluated as soon as
    it is trained); the demo's stdout is kept in demo.out."""
    root = tmp_path_factory.mktemp("scripts")
    jobs = {}
    for name, (script, extra) in TRAININGS.items():
        where = {"DATA": str(root / ("lm-bin" if name.startswith("lm") else "nmt-bin")), "SAVE_DIR": str(root / name)}
        jobs[name] = ((script, {**where, "MAX_UPDATE": "3", "LOG_INTERVAL": "1", **extra}),
                      (f"{name.split('_')[0]}/evaluate.sh", {**where, "BEAM": "1", "MAX_LEN_B": "8",
                                                             "MP": extra.get("MP", "1")}))
    jobs["demo"] = (("demo.sh", _demo_env(root)),)
    # the demo (the longest chain: two trainings, then ten steps one after the other) starts with the data;
    # the recipes go RECIPES_AT_ONCE at a time, the largest first, each evaluated as soon as it is trained
    with ThreadPoolExecutor(3) as pool, ThreadPoolExecutor(RECIPES_AT_ONCE) as recipes:
        data = {"lm": pool.submit(_prepare_lm, root), "nmt": pool.submit(_prepare_nmt, root)}

        def run(name: str) -> list[subprocess.CompletedProcess]:
            for kind in (data if name == "demo" else [name.split("_")[0]]):
                data[kind].result()
            return _steps(*jobs[name])

        demo = pool.submit(run, "demo")
        done = {**dict(zip(TRAININGS, recipes.map(run, TRAININGS))), "demo": demo.result()}
    for name, procs in done.items():
        last = procs[-1]
        assert last.returncode == 0, (f"{name}: {last.args[1]} exited {last.returncode}:\n"
                                      f"{last.stdout[-3000:]}{last.stderr[-3000:]}")
    (root / "demo.out").write_text(done["demo"][0].stdout)
    return {name: root / name for name in [*TRAININGS, DEMO_NMT]}


@pytest.mark.parametrize("name", ["lm_dense_full", "lm_moe_mp2", "lm_dense_pp2", "lm_long_context"])
def test_lm_recipes_train_and_report_perplexity(runs: dict[str, Path], name: str) -> None:
    save = runs[name]
    mp2 = ["checkpoint_best-model_part-0.pt", "checkpoint_best-model_part-1.pt"]
    parts = {"lm_moe_mp2": mp2, "lm_long_context": mp2,
             "lm_dense_pp2": ["checkpoint_best-stage0.pt", "checkpoint_best-stage1.pt",
                              "checkpoint_best.one_stage.pt"]}.get(name, ["checkpoint_best.pt"])
    assert sorted(p.name for p in save.glob("checkpoint_best*.pt")) == parts
    log = plot_logs.parse_log(save / "train.log")
    assert [r["num_updates"] for r in log.records["train_inner"]] == ["1", "2", "3"]
    assert log.records["valid"][-1]["valid_num_updates"] == "3"
    if name.startswith("lm_moe"):
        assert "moe_entropy" in log.records["train_inner"][-1]
    if name == "lm_dense_full":  # DeepNorm, FSDP2 over 2 ranks; its checkpoint evaluates as any other
        text = (save / "train.log").read_text()
        assert "'zero_sharding': 'full'" in text and "'backbone': deepnorm" in text
    if name == "lm_long_context":
        text = (save / "train.log").read_text()
        assert all(f in text for f in ("'context_parallel_size': 2", "'sequence_parallel': True",
                                       "'checkpoint_activations': selective", "'tokens_per_sample': 64"))
    fields = dict(line.split(" ", 1) for line in (save / "eval_test.txt").read_text().splitlines())
    ppl, loss2 = float(fields["perplexity"]), float(fields["loss_base2"])
    assert fields["subset"] == "test" and ppl > 1
    assert ppl == pytest.approx(2**loss2, rel=1e-3)


@pytest.mark.parametrize("name", ["nmt_moe", "nmt_dense_mp2"])
def test_nmt_recipes_train_and_report_bleu_and_chrf(runs: dict[str, Path], name: str) -> None:
    save = runs[name]
    if name.endswith("mp2"):
        assert (save / "checkpoint_best-model_part-1.pt").is_file() and not (save / "checkpoint_best.pt").exists()
        assert "'backbone': postln" in (save / "train.log").read_text()
    hyps = (save / "hyp_test.es").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 4
    scores = dict(line.split(" ", 1) for line in (save / "bleu_test.txt").read_text().splitlines())
    refs = ES[-4:]
    assert float(scores["bleu"]) == pytest.approx(round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2))
    assert float(scores["chrf"]) == pytest.approx(round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2))
    log = plot_logs.parse_log(save / "train.log")
    if name == "nmt_moe":
        last = log.records["train_inner"][-1]
        assert {"moe_entropy", "gnorm_dense", "gnorm_expert", "clip"} <= set(last)


def test_evaluating_parts_at_another_mp_is_one_line(runs: dict[str, Path]) -> None:
    save = runs["lm_moe_mp2"]
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "lm/evaluate.sh")], capture_output=True, text=True,
                          env=_env(DATA=str(save.parent / "lm-bin"), SAVE_DIR=str(save)), timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "was saved at MP=2: evaluate it with MP=2" in lines[0], proc.stderr


def test_plot_tool_writes_pngs_from_real_logs(runs: dict[str, Path], tmp_path: Path) -> None:
    logs = [str(runs[name] / "train.log") for name in [*TRAININGS, DEMO_NMT]]
    written = plot_logs.main([*logs, "--out-dir", str(tmp_path)])
    assert sorted(p.name for p in written) == ["clipping.png", "routing_entropy.png", "valid_ppl.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    log = plot_logs.parse_log(runs["nmt_moe"] / "train.log")
    clips = [float(r["clip"]) for r in log.records["train_inner"]]
    assert plot_logs.clipped_updates(log) == ([1.0, 2.0, 3.0], pytest.approx(
        [sum(clips[: i + 1]) / 100 for i in range(3)]))
    dense = plot_logs.parse_log(runs["lm_dense_full"] / "train.log")
    assert plot_logs.entropy_keys(dense) == []


def test_unigram_baseline_is_the_add_one_formula() -> None:
    """p(w) = (c(w) + 1) / (N + V): train [5, 5, 6] over V = 4 gives p(5) = 3/7, p(6) = 2/7."""
    ppl = unigram_ppl.unigram_perplexity(np.array([5, 5, 6]) - 3, np.array([5, 6]) - 3, 4)
    assert ppl == pytest.approx(math.exp(-(math.log(3 / 7) + math.log(2 / 7)) / 2))


def test_demo_runs_at_toy_size_and_prints_its_baselines(runs: dict[str, Path], capsys) -> None:
    """scripts/demo.sh (adaptive-softmax LM, X-MoE NMT) on the tiny data, run by the fixture."""
    root = runs[DEMO_NMT].parent
    stdout = (root / "demo.out").read_text()
    summary = dict(line.split(":", 1) for line in stdout.split("demo summary")[1].splitlines() if ": " in line)
    assert "adaptive input/softmax at 2000,10000, 3 updates" in summary["model"]
    unigram = unigram_ppl.main([str(root / "lm-bin"), "--subset", "valid"])
    assert f"perplexity {unigram:.1f} for word frequencies alone" in stdout
    copy_bleu, copy_chrf = (round(m(EN[-4:], [ES[-4:]]).score, 2) for m in (sacrebleu.corpus_bleu, sacrebleu.corpus_chrf))
    assert f"BLEU {copy_bleu}, chrF {copy_chrf} for copying the English verse" in summary["baseline"]
    assert "nrefs:1" in summary["nmt test"]
    # the demo's transformers export: it translated the first test verse through its tokenizer, and on the
    # whole test split (fairseq-generate's batches, whose width sets the length limit) it gives the
    # hypotheses of the demo's fairseq-generate run (beam, n-gram blocking and limits of the evaluation)
    from data_prep.score_nmt import read_hypotheses
    from torchscale_fairseq.interop import hf_translate

    [source, translation] = stdout.split("through transformers: ")[1].splitlines()[:2]
    assert source == EN[-4] and translation.startswith("          -> ") and translation.strip() != "->"
    hf_translate.main(["--folder", str(root / DEMO_NMT / "hf"), "--data", str(root / "nmt-bin"), "--beam", "1",
                       "--max-len-a", "1.2", "--max-len-b", "40", "--no-repeat-ngram-size", "3"])
    (root / "hf_generate.txt").write_text(capsys.readouterr().out)
    assert read_hypotheses(root / "hf_generate.txt") == read_hypotheses(root / DEMO_NMT / "generate_test.txt")
    assert sorted(p.name for p in (root / "demo_plots").iterdir()) == ["clipping.png", "routing_entropy.png",
                                                                         "valid_ppl.png"]


def test_plot_tool_rejects_a_log_without_json_records(tmp_path: Path) -> None:
    (tmp_path / "x.log").write_text("2026 | INFO | train | epoch 001 | loss 3.2\n")
    with pytest.raises(SystemExit, match="no fairseq JSON log records"):
        plot_logs.main([str(tmp_path / "x.log"), "--out-dir", str(tmp_path)])


def test_bad_settings_give_one_line_errors(tmp_path: Path) -> None:
    for name in ("dict.txt", "train.bin", "valid.bin"):  # past ts_need_data, for the MoE check
        (tmp_path / name).touch()
    for script, extra, message in (
        ("lm/train_dense.sh", {"ZERO": "zero3"}, "ZERO=zero3: choose none, os or full"),
        ("lm/train_dense.sh", {"ZERO": "full"}, "ZERO=full shards over data-parallel ranks and this run has one"),
        ("lm/train_dense.sh", {"ZERO": "full", "NPROC_PER_NODE": "4", "PP": "2"}, "ZERO=full with PP=2"),
        ("lm/train_dense.sh", {"ZERO": "full", "NPROC_PER_NODE": "2", "PRECISION": "fp16"},
         "ZERO=full keeps fp32 shards and computes in bf16"),
        ("lm/train_moe.sh", {"ZERO": "full", "NPROC_PER_NODE": "2", "DATA": str(tmp_path)}, "ZERO=full with experts"),
        ("nmt/train_dense.sh", {"ZERO": "full", "NPROC_PER_NODE": "2"}, "ZERO=full runs the LM recipes (ts_lm) only"),
        ("lm/train_dense.sh", {"SCALE": "huge"}, "SCALE=huge: choose full or tiny"),
        ("lm/train_dense.sh", {"DATA": str(tmp_path / "none")}, f"{tmp_path}/none/dict.txt not found"),
        ("nmt/train_moe.sh", {"NPROC_PER_NODE": "3", "MP": "2"}, "MP=2 does not divide the 3 processes"),
        ("lm/train_dense.sh", {"NPROC_PER_NODE": "2", "PP": "4"}, "MP x PP = 4 does not divide the 2 processes"),
        ("nmt/train_dense.sh", {"PP": "2"}, "PP=2: pipeline parallelism runs the LM recipes (ts_lm) only"),
        ("nmt/train_dense.sh", {"CP": "2"}, "CP=2: context parallelism runs the LM recipes (ts_lm) only"),
        ("lm/train_long_context.sh", {"NPROC_PER_NODE": "4", "CP": "4"}, "MP x PP x CP = 8 does not divide the 4 processes"),
        ("lm/train_long_context.sh", {"TOKENS_PER_SAMPLE": "60"},
         "TOKENS_PER_SAMPLE=60 does not split into 2 x CP x MP = 8 equal chunks"),
        ("nmt/evaluate.sh", {}, "set SAVE_DIR"),
        ("demo.sh", {"PARALLEL": "yes"}, "PARALLEL=yes: set it to 0 or 1"),
    ):
        proc = subprocess.run(["bash", str(ROOT / "scripts" / script)], env=_env(**extra), capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("[") and message in lines[0], proc.stderr


def test_unigram_baseline_of_a_translation_target_side(tmp_path: Path, capsys) -> None:
    """--pair en-es scores dict.es.txt / *.en-es.es: train [a a b </s>], valid [a b </s>] over V = 6."""
    from fairseq.data import Dictionary, indexed_dataset

    (tmp_path / "dict.es.txt").write_text("a 2\nb 1\n")
    dictionary = Dictionary.load(str(tmp_path / "dict.es.txt"))
    a, b, eos = dictionary.index("a"), dictionary.index("b"), dictionary.eos()
    for split, ids in (("train", [a, a, b, eos]), ("valid", [a, b, eos])):
        prefix = str(tmp_path / f"{split}.en-es.es")
        builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=len(dictionary))
        builder.add_item(torch.IntTensor(ids))
        builder.finalize(prefix + ".idx")
    counts = {a: 3, b: 2, eos: 2}  # add-one over the 6 entries (4 specials, a, b): 4 + 6 = 10
    expected = math.exp(-sum(math.log(counts[i] / 10) for i in (a, b, eos)) / 3)
    assert unigram_ppl.main([str(tmp_path), "--pair", "en-es"]) == pytest.approx(expected)
    assert capsys.readouterr().out == f"unigram_ppl {expected:.1f}\n"
    with pytest.raises(SystemExit):
        unigram_ppl.main([str(tmp_path)])  # no dict.txt: a translation dataset needs --pair
    assert "needs --pair SRC-TGT" in capsys.readouterr().err
