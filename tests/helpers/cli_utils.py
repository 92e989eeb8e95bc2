"""Helpers for tests that drive the real fairseq console tools on tiny data."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tests.helpers import prewarmed

REPO = Path(__file__).resolve().parents[2]
WORKERS = REPO / "tests" / "workers"
USER_DIR = str(REPO / "torchscale_fairseq")
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    return str(BIN / name)


def cli_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of every test run: one thread, so results are bitwise repeatable."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(extra or {}))


def run(cmd: Sequence[str], cwd: Optional[Path] = None, check: bool = True, timeout: int = 600,
        env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run a command (a Python program: from :mod:`tests.helpers.prewarmed`); on failure raise with its
    output (tail) in the message."""
    proc = prewarmed.run(cmd, cwd=cwd, timeout=timeout, env=cli_env(env))
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_many(cmds: Sequence[Sequence[str]], check: bool = True) -> List[subprocess.CompletedProcess]:
    """:func:`run` every command, as many at once as there are cores (each run is one
    thread, and mostly fairseq's import); results in the order of ``cmds``."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(lambda cmd: run(cmd, check=check), cmds))


def _sentence(rng: random.Random, words: List[str]) -> List[str]:
    """A word chain with a learnable successor rule, so a tiny model's loss can fall."""
    out = [rng.choice(words[:10])]
    for _ in range(rng.randint(4, 14)):
        i = words.index(out[-1])
        out.append(words[(i * 7 + 3) % len(words)] if rng.random() < 0.8 else rng.choice(words))
    return out


def make_text(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(60)]
    path.write_text("\n".join(" ".join(_sentence(rng, words)) for _ in range(n)) + "\n")


def make_lm_data(root: Path) -> Path:
    """Binarised monolingual data in ``root/lm-bin``."""
    for split, n, seed in (("train", 600, 1), ("valid", 60, 2), ("test", 60, 3)):
        make_text(root / f"{split}.txt", n, seed)
    out = root / "lm-bin"
    run([tool("fairseq-preprocess"), "--only-source", "--trainpref", root / "train.txt", "--validpref",
         root / "valid.txt", "--testpref", root / "test.txt", "--destdir", out, "--workers", "1"])
    return out


def make_mt_data(root: Path) -> Path:
    """Binarised parallel data (target = reversed, upper-cased source) in ``root/mt-bin``."""
    for split, n, seed in (("train", 600, 11), ("valid", 60, 12), ("test", 40, 13)):
        make_text(root / f"{split}.src", n, seed)
        lines = (root / f"{split}.src").read_text().splitlines()
        (root / f"{split}.tgt").write_text("\n".join(" ".join(reversed(s.split())).upper() for s in lines) + "\n")
    out = root / "mt-bin"
    run([tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt", "--trainpref", root / "train",
         "--validpref", root / "valid", "--testpref", root / "test", "--destdir", out, "--joined-dictionary",
         "--workers", "1"])
    return out


def json_logs(text: str, tag: str) -> List[dict]:
    """fairseq ``--log-format json`` records of one kind (``train_inner``, ``valid``, ``train``)."""
    records = []
    for line in text.splitlines():
        start = line.find("{")
        if start < 0 or f"| {tag} |" not in line:
            continue
        try:
            records.append(json.loads(line[start:]))
        except json.JSONDecodeError:
            continue
    return records


LM_TRAIN = [
    "--task", "language_modeling", "--tokens-per-sample", "32", "--sample-break-mode", "none",
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt",
    "--warmup-updates", "5", "--batch-size", "16", "--cpu", "--log-format", "json", "--log-interval", "5",
    "--no-epoch-checkpoints", "--share-decoder-input-output-embed", "--seed", "1",
]

MT_TRAIN = [
    "--task", "translation", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "3e-3",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "5", "--max-tokens", "1200", "--cpu",
    "--log-format", "json", "--log-interval", "5", "--no-epoch-checkpoints", "--criterion",
    "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--share-all-embeddings", "--seed", "1",
]


def last_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    return lines[-1] if lines else ""
