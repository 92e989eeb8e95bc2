"""Shared helpers of the benchmark scripts: synthetic corpora, running fairseq CLIs,
parsing their logs. Not a benchmark itself."""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the plugin and data_prep, imported from this checkout
    sys.path.insert(0, str(REPO))
USER_DIR = REPO / "torchscale_fairseq"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """Path of a fairseq console script next to this interpreter (the venv's)."""
    path = BIN / name
    if not path.exists():
        raise SystemExit(f"{name} not found next to {sys.executable}: run with the project's .venv/bin/python")
    return str(path)


def now() -> str:
    return subprocess.run(["date"], capture_output=True, text=True).stdout.strip()


PRECISION_FLAGS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}
KERNEL_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")  # runtime calls
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def device_flags(device: str) -> List[str]:
    """fairseq flags that select ``device`` (``cpu`` or ``cuda``)."""
    if device not in ("cpu", "cuda"):
        raise SystemExit(f"--device {device}: use cpu or cuda")
    return ["--cpu"] if device == "cpu" else []


def decoder_dim_flags(dims: str) -> List[str]:
    """fairseq-train flags of a decoder of ``dims`` = ``"layers width heads ffn_width"``."""
    layers, dim, heads, ffn = dims.split()
    return ["--decoder-layers", layers, "--decoder-embed-dim", dim, "--decoder-attention-heads", heads,
            "--decoder-ffn-embed-dim", ffn]


def device_line(device: str) -> str:
    """What a result was measured on: GPU, driver, torch and CUDA versions (or the CPU)."""
    if device == "cuda":
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        driver = smi.stdout.strip() or "?"
        return (f"{torch.cuda.get_device_name(0)}, driver {driver}, torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}")
    return f"CPU, {os.cpu_count()} cores, torch {torch.__version__}"


DATASHEET_BF16 = 989e12  # dense bf16 FLOP/s of the H100 SXM and the H200 (NVIDIA datasheets)
# memory bandwidth in bytes/s by the name torch gives the GPU (NVIDIA datasheets): H200 HBM3e, H100 SXM HBM3
DATASHEET_HBM = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}


def datasheet_hbm(device: str) -> Optional[float]:
    """The datasheet memory bandwidth (bytes/s) of ``device``'s GPU; ``None`` on the CPU or a GPU not listed."""
    if device != "cuda":
        return None
    return DATASHEET_HBM.get(torch.cuda.get_device_name(0))


def git_commit() -> str:
    """``TS_COMMIT`` where set (a copy of the working tree whose git metadata is not its own, as the
    device tool's), else HEAD's short hash, `` (modified)`` when the working tree differs from it."""
    if os.environ.get("TS_COMMIT"):
        return os.environ["TS_COMMIT"]
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD"], capture_output=True).returncode != 0
    return (out.stdout.strip() or "?") + (" (modified)" if dirty else "")


def append_results(path: Path, rows: Sequence[tuple[str, float, Optional[float]]], device: str, command: str) -> None:
    """Append one JSON line per ``(metric, value, target)`` to ``path`` (``benchmarks/gpu_results.jsonl``'s
    format: date, commit, device, torch, metric, value, target, command)."""
    base = {"date": now(), "commit": git_commit(), "device": device_line(device), "torch": torch.__version__}
    with Path(path).open("a") as f:
        for metric, value, target in rows:
            f.write(json.dumps({**base, "metric": metric, "value": round(value, 4), "target": target,
                                "command": command}) + "\n")


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def rendezvous_url(directory: Path | str) -> str:
    """A ``file://`` init method in ``directory`` that no other launch uses: where the ranks of a
    multi-process run meet (the tests' too). ``free port`` helpers (bind to 0, close, pass the
    number on) race: another launch may take the port before rank 0 binds it. A file in the run's
    own directory cannot collide; torch's ``FileStore`` creates it, and each launch (a restart
    included) gets a new name, since a killed run leaves its file behind. Gloo then connects the
    ranks on ports the OS assigns."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    return (directory / f"rendezvous-{uuid.uuid4().hex}").as_uri()


# ---------------------------------------------------------------- synthetic text

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck"]


def make_words(n: int, rng: random.Random, suffix: str = "") -> List[str]:
    """``n`` distinct pronounceable pseudo-words (shorter words first, like real text)."""
    words: List[str] = []
    seen = set()
    while len(words) < n:
        syllables = 1 + min(3, int(rng.expovariate(1.0) + 0.5 * len(words) / max(1, n)))
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)) + suffix
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def zipf_probs(n: int, exponent: float = 1.0) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** exponent
    return p / p.sum()


def sentence_lengths(rng: np.random.Generator, count: int, low: int, high: int) -> np.ndarray:
    return rng.integers(low, high + 1, size=count)


def write_lm_corpus(out: Path, vocab: int, tokens: int, seed: int = 1) -> Dict[str, Path]:
    """Zipf-distributed text over ``vocab`` pseudo-words, one sentence per line, documents
    separated by blank lines; train ~``tokens`` words, valid/test 5% each."""
    out.mkdir(parents=True, exist_ok=True)
    words = np.array(make_words(vocab, random.Random(seed)))
    probs = zipf_probs(vocab)
    rng = np.random.default_rng(seed)
    paths = {}
    for split, n_tokens in (("train", tokens), ("valid", max(2000, tokens // 20)), ("test", max(2000, tokens // 20))):
        path = out / f"{split}.txt"
        written = 0
        with path.open("w") as f:
            while written < n_tokens:
                for length in sentence_lengths(rng, rng.integers(3, 11), 6, 40):
                    f.write(" ".join(words[rng.choice(vocab, size=length, p=probs)]) + " .\n")
                    written += length + 1
                f.write("\n")
        paths[split] = path
    return paths


def write_parallel_corpus(out: Path, vocab: int, pairs: Dict[str, int], seed: int = 1) -> None:
    """A synthetic language pair ``src``-``tgt``: target words are a fixed word-for-word
    mapping of the source (a few source words map to two target words), with adjacent
    pairs swapped, so there is something learnable. Files ``{split}.src`` / ``{split}.tgt``."""
    out.mkdir(parents=True, exist_ok=True)
    pyrng = random.Random(seed)
    src_words = np.array(make_words(vocab, pyrng))
    tgt_words = make_words(vocab + 200, pyrng, suffix="x")
    mapping = [tgt_words[i] if i % 17 else tgt_words[i] + " " + tgt_words[vocab + i % 200] for i in range(vocab)]
    probs = zipf_probs(vocab)
    rng = np.random.default_rng(seed)
    for split, count in pairs.items():
        with (out / f"{split}.src").open("w") as fs, (out / f"{split}.tgt").open("w") as ft:
            for length in sentence_lengths(rng, count, 5, 30):
                ids = rng.choice(vocab, size=length, p=probs)
                tgt_ids = list(ids)
                for i in range(0, length - 1, 2):
                    tgt_ids[i], tgt_ids[i + 1] = tgt_ids[i + 1], tgt_ids[i]
                fs.write(" ".join(src_words[ids]) + " .\n")
                ft.write(" ".join(mapping[i] for i in tgt_ids) + " .\n")


def run(cmd: Sequence[str], log: Optional[Path] = None, env: Optional[dict] = None) -> str:
    """Run ``cmd``; return stdout+stderr (also written to ``log``); exit on failure."""
    return run_together([cmd], [log], env)[0]


def run_together(
    cmds: Sequence[Sequence[str]], logs: Sequence[Optional[Path]], env: Optional[dict] = None
) -> List[str]:
    """Start all ``cmds`` at once, wait for all; their outputs, in order (see :func:`run`)."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    if env:
        full_env.update(env)
    procs = [subprocess.Popen(list(c), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
             for c in cmds]
    outputs = [p.communicate()[0] for p in procs]
    for cmd, proc, out, log in zip(cmds, procs, outputs, logs):
        if log is not None:
            log.write_text(" ".join(cmd) + "\n\n" + out)
        if proc.returncode != 0:
            tail = "\n".join(out.splitlines()[-40:])
            raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return outputs


def preprocess_lm(text: Dict[str, Path], dest: Path, workers: int = 2) -> Path:
    if (dest / "dict.txt").exists() and (dest / "train.bin").exists():
        return dest  # a --workdir of an earlier run (the synthetic text is deterministic)
    run([
        tool("fairseq-preprocess"), "--only-source",
        "--trainpref", str(text["train"]), "--validpref", str(text["valid"]), "--testpref", str(text["test"]),
        "--destdir", str(dest), "--workers", str(workers),
    ])
    return dest


def preprocess_translation(raw: Path, dest: Path, workers: int = 2) -> Path:
    run([
        tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", str(raw / "train"), "--validpref", str(raw / "valid"), "--testpref", str(raw / "test"),
        "--destdir", str(dest), "--workers", str(workers),
    ])
    return dest


def dict_size(data: Path, name: str = "dict.txt") -> int:
    with (data / name).open() as f:
        return sum(1 for _ in f)


# ---------------------------------------------------------------- fairseq in this process

def import_plugin() -> None:
    """Import this plugin into fairseq as ``--user-dir`` does (registers its models, installs its trainer)."""
    from argparse import Namespace

    from fairseq import utils

    utils.import_user_module(Namespace(user_dir=str(USER_DIR)))


def fairseq_lm(model_args: Sequence[str], vocab: int, tokens_per_sample: int) -> tuple:
    """The config, task, model and criterion ``fairseq-train --user-dir torchscale_fairseq --cpu``
    builds for a language model over a synthetic dictionary ``w0 .. w{vocab-1}`` (no data is
    read): dropout 0.1, Adam at lr 5e-4, tied embeddings, unless ``model_args`` (last) override them."""
    from fairseq import options
    from fairseq.data import Dictionary
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.tasks.language_modeling import LanguageModelingTask

    import_plugin()
    argv = ["DUMMY", "--user-dir", str(USER_DIR), "--task", "language_modeling", "--cpu",
            "--tokens-per-sample", str(tokens_per_sample), "--sample-break-mode", "none",
            "--share-decoder-input-output-embed", "--dropout", "0.1", "--optimizer", "adam", "--lr", "5e-4",
            *model_args]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    dictionary = Dictionary()
    for i in range(vocab):
        dictionary.add_symbol(f"w{i}")
    task = LanguageModelingTask(cfg.task, dictionary, dictionary)
    return cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion)


def lm_sample(dictionary, batch_size: int, length: int, generator: Optional[torch.Generator] = None) -> dict:
    """A fairseq language-model batch of ``batch_size`` x ``length`` random non-special tokens
    (no padding), drawn from ``generator`` (torch's global one by default)."""
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (batch_size, length + 1), generator=generator)
    return {"id": torch.arange(batch_size), "nsentences": batch_size, "ntokens": batch_size * length,
            "target": tokens[:, 1:].contiguous(),
            "net_input": {"src_tokens": tokens[:, :-1].contiguous(),
                          "src_lengths": torch.full((batch_size,), length)}}


# ---------------------------------------------------------------- log parsing

_JSON_LOG = re.compile(r"\|\s*(train_inner|train)\s*\|\s*(\{.*\})\s*$")


def train_inner_logs(output: str) -> List[dict]:
    """The JSON ``train_inner`` records of a ``fairseq-train --log-format json`` run."""
    records = []
    for line in output.splitlines():
        m = _JSON_LOG.search(line)
        if m and m.group(1) == "train_inner":
            records.append(json.loads(m.group(2)))
    return records


def num_params(output: str) -> Optional[int]:
    m = re.search(r"num\. (?:shared )?model params: ([\d,]+)", output)
    return int(m.group(1).replace(",", "")) if m else None


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


class Stopwatch:
    def __enter__(self) -> "Stopwatch":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def report_ratios(results: dict, unit: str, fmt: str, target: float) -> float:
    """Print per-round ours/stock ratios, their median and the verdict; return the median."""
    from statistics import median

    ratios = [o / s for o, s in zip(results["ours"], results["stock"])]
    ratio = median(ratios)
    print(f"median {unit} ours: {median(results['ours']):{fmt}}  stock: {median(results['stock']):{fmt}}")
    print(f"ratios per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    verdict = "PASS" if ratio >= target else "FAIL"
    print(f"RESULT ratio ours/stock (median of rounds): {ratio:.3f}  target >= {target}: {verdict}")
    return ratio
