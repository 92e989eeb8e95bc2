"""Checkpoint reload, fairseq-eval-lm, fairseq-generate, fairseq-interactive and the hub
interface on checkpoints trained through the real CLI."""

import math
import re

import pytest
import torch

from tests.helpers.cli_utils import LM_TRAIN, MT_TRAIN, USER_DIR, run_many, tool


@pytest.fixture(scope="module")
def checkpoints(lm_data, mt_data, tmp_path_factory) -> dict:
    """An LM (40 updates) and a translation model (120 updates), trained side by side."""
    lm, mt = tmp_path_factory.mktemp("lm_ck"), tmp_path_factory.mktemp("mt_ck")
    run_many([
        [tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update", "40",
         "--save-dir", lm, *LM_TRAIN],
        [tool("fairseq-train"), mt_data, "--user-dir", USER_DIR, "--arch", "ts_transformer_tiny", "--max-update",
         "120", "--save-dir", mt, "--dropout", "0.0", *MT_TRAIN],
    ])
    return {"lm": lm, "mt": mt}


@pytest.fixture(scope="module")
def lm_ckpt(checkpoints):
    return checkpoints["lm"]


@pytest.fixture(scope="module")
def mt_ckpt(checkpoints):
    return checkpoints["mt"]


def eval_lm(lm_data, path, *extra) -> list:
    return [tool("fairseq-eval-lm"), lm_data, "--path", path, "--user-dir", USER_DIR, "--cpu", "--tokens-per-sample",
            "32", "--batch-size", "8", *extra]


@pytest.fixture(scope="module")
def runs(lm_data, mt_data, lm_ckpt, mt_ckpt, tmp_path_factory) -> dict:
    """Every console-tool run of the tests below, started together (``run_many``: two at a time):
    the LM trained on from its checkpoint to 45 updates, ``fairseq-eval-lm`` of its best checkpoint
    (plain, and as an ``--fp8`` checkpoint refused and overridden), ``fairseq-generate`` batched and one
    sentence at a time, and ``fairseq-interactive`` on two test sources."""
    import shutil

    tmp = tmp_path_factory.mktemp("eval_runs")
    shutil.copytree(lm_ckpt, tmp / "ck")
    state = torch.load(lm_ckpt / "checkpoint_best.pt", weights_only=False)
    state["cfg"]["model"]["fp8"] = "tensorwise"
    torch.save(state, tmp / "fp8.pt")
    src = open(mt_data.parent / "test.src").read().splitlines()[:2]
    (tmp / "in.txt").write_text("\n".join(src) + "\n")
    generate = [tool("fairseq-generate"), mt_data, "--path", mt_ckpt / "checkpoint_best.pt", "--user-dir", USER_DIR,
                "--cpu", "--beam", "4", "--gen-subset", "test"]
    cmds = {
        "reload": [tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update",
                   "45", "--save-dir", tmp / "ck", *LM_TRAIN],
        "eval_lm": eval_lm(lm_data, lm_ckpt / "checkpoint_best.pt"),
        "fp8_refused": eval_lm(lm_data, tmp / "fp8.pt"),
        "fp8_overridden": eval_lm(lm_data, tmp / "fp8.pt", "--model-overrides", "{'fp8': 'none'}"),
        "generate_batched": [*generate, "--batch-size", "16"],
        "generate_single": [*generate, "--batch-size", "1"],
        "interactive": [tool("fairseq-interactive"), mt_data, "--path", mt_ckpt / "checkpoint_best.pt", "--user-dir",
                        USER_DIR, "--cpu", "--beam", "2", "--source-lang", "src", "--target-lang", "tgt", "--input",
                        tmp / "in.txt"],
    }
    return {"save": tmp / "ck", **dict(zip(cmds, run_many(list(cmds.values()), check=False)))}


def ok(proc):
    assert proc.returncode == 0, f"{' '.join(map(str, proc.args))} exited {proc.returncode}:\n{proc.stderr[-5000:]}"
    return proc


def test_checkpoint_reload_continues_training(lm_ckpt, runs):
    before = torch.load(lm_ckpt / "checkpoint_last.pt", weights_only=True)
    proc = ok(runs["reload"])
    out = proc.stdout + proc.stderr
    assert "Loaded checkpoint" in out and "@ 40 updates" in out
    after = torch.load(runs["save"] / "checkpoint_last.pt", weights_only=True)
    assert after["optimizer_history"][-1]["num_updates"] == 45
    assert before["extra_state"]["train_iterator"]["epoch"] <= after["extra_state"]["train_iterator"]["epoch"]


def test_eval_lm_reports_perplexity(lm_data, runs):
    proc = ok(runs["eval_lm"])
    match = re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", proc.stdout + proc.stderr)
    assert match, proc.stderr[-2000:]
    loss, ppl = float(match.group(1)), float(match.group(2))
    assert ppl == pytest.approx(2**loss, rel=1e-3)
    vocab = sum(1 for _ in open(lm_data / "dict.txt"))
    assert ppl < vocab / 4  # the successor rule is learnt: far better than uniform


def _hypotheses(text: str) -> dict:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^H-(\d+)\t[-\d.e]+\t(.*)$", text, re.M)}


def test_generate_batched_beam_equals_one_at_a_time(runs):
    batched, single = ok(runs["generate_batched"]), ok(runs["generate_single"])
    hyps_b, hyps_s = _hypotheses(batched.stdout), _hypotheses(single.stdout)
    assert len(hyps_b) == 40 and hyps_b == hyps_s
    bleu = float(re.search(r"BLEU4 = ([\d.]+)", batched.stdout).group(1))
    assert bleu > 20, batched.stdout[-500:]


def test_interactive_translates(runs):
    hyps = re.findall(r"^H-\d+\t[-\d.e]+\t(.*)$", ok(runs["interactive"]).stdout, re.M)
    assert len(hyps) == 2 and all(h.strip() for h in hyps)


def test_hub_interface_translate_and_sample(mt_data, mt_ckpt, lm_data, lm_ckpt):
    from torchscale_fairseq.models.lm import TsLanguageModel
    from torchscale_fairseq.models.transformer import TsTransformerModel

    mt = TsTransformerModel.from_pretrained(str(mt_ckpt), "checkpoint_best.pt", data_name_or_path=str(mt_data),
                                            source_lang="src", target_lang="tgt")
    src = open(mt_data.parent / "test.src").read().splitlines()[0]
    out = mt.translate(src, beam=2)
    assert isinstance(out, str) and out.strip()
    lm = TsLanguageModel.from_pretrained(str(lm_ckpt), "checkpoint_best.pt", data_name_or_path=str(lm_data))
    sample = lm.sample("w1 w2", beam=1, sampling=True, sampling_topk=5, max_len_b=8, seed=1)
    assert sample.startswith("w1 w2") and len(sample.split()) > 2
    scored = lm.score("w1 w2 w3")
    assert math.isfinite(float(scored["positional_scores"].mean()))


def test_fp8_checkpoint_evaluates_on_cpu_with_the_named_override(runs):
    """A checkpoint whose config says ``--fp8`` (FP8 changes the GEMMs, not the parameters) is
    refused on the CPU in one line naming ``--model-overrides``; with it, it scores exactly as the
    same weights saved without ``--fp8``."""
    refused, overridden, plain = runs["fp8_refused"], runs["fp8_overridden"], runs["eval_lm"]
    assert refused.returncode != 0
    assert "--model-overrides \"{'fp8': 'none'}\"" in refused.stderr.strip().splitlines()[-1]
    ppl = [re.search(r"Perplexity: ([\d.]+)", p.stdout + p.stderr) for p in (overridden, plain)]
    assert all(ppl), overridden.stderr[-2000:]
    assert ppl[0].group(1) == ppl[1].group(1)
