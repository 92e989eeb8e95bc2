"""End to end: ``data_prep`` vs ``streaming_lm`` token streams, training, SIGKILL resume,
``fairseq-interactive`` and the hub with ``--bpe tiktoken_gpt2``."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from data_prep import prepare_lm
from tests.helpers import prewarmed
from tests.helpers.cli_utils import WORKERS, json_logs, run, tool
from tests.helpers.stream_data import make_docs, write_shard
from tests.tasks.conftest import USER_DIR, build_task
from torchscale_fairseq.data import gpt2_bpe

STALL_CLI = WORKERS / "stall_cli.py"

TRAIN = ["--user-dir", USER_DIR, "--task", "streaming_lm", "--arch", "ts_lm_tiny", "--tokens-per-sample", "32",
         "--optimizer", "adam", "--lr", "1e-3", "--batch-size", "8", "--batches-per-epoch", "4", "--num-workers", "2",
         "--cpu", "--no-epoch-checkpoints", "--share-decoder-input-output-embed", "--log-format", "json",
         "--log-interval", "1", "--save-interval-updates", "3", "--seed", "1"]
PROMPTS = ["Hello world, this is a test.", "café naïve river stone"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """``data_prep.prepare_lm`` output for a tiny text, and a stream index over its raw text."""
    root = tmp_path_factory.mktemp("lm")
    for split, n, seed in (("train", 60, 1), ("valid", 6, 2), ("test", 6, 3)):
        write_shard(root / f"{split}.txt", make_docs(n, seed))
    prepare_lm.main(["--train-text", str(root / "train.txt"), "--valid-text", str(root / "valid.txt"),
                     "--test-text", str(root / "test.txt"), "--out-dir", str(root / "bin"), "--workers", "1"])
    (root / "stream" / "json").mkdir(parents=True)
    for split in ("train", "valid"):
        entry = [{"source": [str(root / "bin" / "raw" / f"{split}.txt")], "weight": 1.0}]
        (root / "stream" / "json" / f"{split}.json").write_text(json.dumps(entry))
    return root


@pytest.fixture(scope="module")
def trained(prepared: Path) -> tuple[Path, dict]:
    """An uninterrupted 6-update streaming run: its checkpoints and loss per update."""
    save = prepared / "ck_full"
    proc = run([tool("fairseq-train"), prepared / "stream", *TRAIN, "--max-update", "6", "--save-dir", save])
    return save, _losses(proc.stderr + proc.stdout)


def _losses(log: str) -> dict:
    return {int(r["num_updates"]): r["loss"] for r in json_logs(log, "train_inner")}


def test_stream_matches_preprocessed_path(prepared: Path) -> None:
    ref = build_task(prepared / "bin", "language_modeling")
    ref.load_dataset("train")
    ds = ref.dataset("train")
    ref_tgt = torch.cat([ds[i]["target"] for i in range(len(ds))])
    ref_src = torch.cat([ds[i]["source"] for i in range(len(ds))])
    task = build_task(prepared / "stream")
    assert task.dictionary.symbols == ref.dictionary.symbols
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_sentences=4)
    epoch = itr.next_epoch_itr()
    samples = [next(epoch) for _ in range(len(ds) // 4)]
    itr.close()
    tgt = torch.cat([s["target"].reshape(-1) for s in samples])
    src = torch.cat([s["net_input"]["src_tokens"].reshape(-1) for s in samples])
    n = len(ref_tgt) - 16  # data_prep's last block is padded; the stream wraps around instead
    assert len(tgt) >= n and torch.equal(tgt[:n], ref_tgt[:n]) and torch.equal(src[:n], ref_src[:n])


def test_sigkill_resume_gives_the_same_samples(prepared: Path, trained: tuple[Path, dict]) -> None:
    _, full = trained
    save = prepared / "ck_killed"
    log = prepared / "killed.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(STALL_CLI), "3", str(prepared / "stream"), *TRAIN, "--max-update", "50",
           "--save-dir", str(save)]  # stalls after the checkpoint of update 3
    with open(log, "w") as out:
        proc = prewarmed.popen(cmd, out, env=env)
        deadline = time.time() + 300
        while "Saved checkpoint" not in log.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = _losses(log.read_text())
    assert [killed[u] for u in (1, 2, 3)] == [full[u] for u in (1, 2, 3)]
    proc = run([tool("fairseq-train"), prepared / "stream", *TRAIN, "--max-update", "6", "--save-dir", save])
    resumed = _losses(proc.stdout + proc.stderr)
    assert "resumes after batch 3 of epoch 1 (4 per epoch), reading no batch again" in proc.stdout + proc.stderr
    assert sorted(resumed) == [4, 5, 6], resumed
    assert [resumed[u] for u in (4, 5, 6)] == [full[u] for u in (4, 5, 6)]


def test_interactive_round_trips_text(prepared: Path, trained: tuple[Path, dict]) -> None:
    save, _ = trained
    (prepared / "prompts.txt").write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    proc = run([tool("fairseq-interactive"), prepared / "bin", "--user-dir", USER_DIR, "--task", "language_modeling",
                "--path", save / "checkpoint_last.pt", "--bpe", "tiktoken_gpt2", "--cpu", "--beam", "1",
                "--max-len-b", "30", "--input", prepared / "prompts.txt"], env={"PYTHONIOENCODING": "utf-8"})
    sources = [line.split("\t")[1] for line in proc.stdout.splitlines() if line.startswith("S-")]
    detok = [line.split("\t")[2] for line in proc.stdout.splitlines() if line.startswith("D-")]
    assert sources == [" ".join(map(str, gpt2_bpe.encode(p))) for p in PROMPTS]
    assert len(detok) == 2 and all(d.startswith(p) for d, p in zip(detok, PROMPTS))


def test_hub_takes_and_gives_raw_text(prepared: Path, trained: tuple[Path, dict]) -> None:
    from torchscale_fairseq.models.lm import TsLanguageModel

    save, _ = trained
    hub = TsLanguageModel.from_pretrained(str(save), "checkpoint_last.pt", data_name_or_path=str(prepared / "bin"),
                                          bpe="tiktoken_gpt2")
    ids = hub.encode(PROMPTS[1])
    assert ids.tolist() == [i + 4 for i in gpt2_bpe.encode(PROMPTS[1])] + [2]
    assert hub.decode(ids) == PROMPTS[1]
    assert hub.sample(PROMPTS[0], beam=1, max_len_b=20).startswith(PROMPTS[0])
