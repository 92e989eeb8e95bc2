"""``--document-masking`` (with ``--reset-positions-at-documents``) under model parallelism, through
``fairseq-train --task streaming_lm`` (one process per rank, gloo, dropout 0), against one process with
the same flags and ``--update-freq``:

- TP = 2 with ``--sequence-parallel``: attention runs on the gathered sequence, so the batch's document
  mask applies as it is; 31-token blocks, so the sequence-parallel padding pads the document ids too;
- PP = 2 (1F1B): every stage reads the micro-batch's ``net_input`` and builds the mask itself;
- C = 2 (``--context-parallel-size``, 32-token blocks against one process on the same blocks), with
  ``--checkpoint-activations selective``: the ring masks each block by the whole sequence's documents.

Every update's loss and ``gnorm`` and every validation loss equal one process (1e-5 relative).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.mp_helpers import relative_close, run_jobs, train_records
from tests.helpers.stream_data import make_stream_data

UPDATES = 4
REL = 1e-5
RUNS = {  # name: (world, flags)
    "one": (1, ()),
    "tp2_sp": (2, ("--model-parallel-size", "2", "--sequence-parallel")),
    "pp2": (2, ("--pipeline-model-parallel-size", "2")),
    "one_32": (1, ("--tokens-per-sample", "32")),
    "cp2": (2, ("--tokens-per-sample", "32", "--context-parallel-size", "2", "--checkpoint-activations", "selective")),
}
REFERENCE = {"tp2_sp": "one", "pp2": "one", "cp2": "one_32"}


def lm_args(data: Path, *extra: str) -> list[str]:
    return [str(data), "--task", "streaming_lm", "--arch", "ts_lm_tiny", "--decoder-layers", "2",
            "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4",
            "--document-masking", "--reset-positions-at-documents", "--decoder-learned-pos",
            "--tokens-per-sample", "31", "--batch-size", "4", "--update-freq", "2", "--batches-per-epoch", "8",
            "--max-update", str(UPDATES), "--optimizer", "adam", "--lr", "1e-3", "--clip-norm", "0.5", "--dropout",
            "0", "--log-format", "json", "--log-interval", "1", "--no-save", "--ddp-backend", "legacy_ddp",
            "--seed", "3", "--validate-interval-updates", "2", "--max-valid-steps", "2", *extra]


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("docmask_mp")
    data = make_stream_data(root / "data", {"c": (2, 12, 1.0)})
    jobs = {name: ("fairseq-train", lm_args(data, *flags), world) for name, (world, flags) in RUNS.items()}
    out, _ = run_jobs(jobs, root, unrounded=True)
    return {name: paths[0] for name, paths in out.items()}


def valid_losses(log: Path) -> list[float]:
    return [float(line[line.index("{"):].split('"valid_loss": "')[1].split('"')[0])
            for line in log.read_text().splitlines() if "valid_loss" in line and "{" in line]


@pytest.mark.parametrize("name", list(REFERENCE))
def test_document_masked_training_equals_one_process(logs, name: str) -> None:
    one, other = train_records(logs[REFERENCE[name]]), train_records(logs[name])
    assert len(one) == len(other) == UPDATES, (len(one), len(other))
    for step, (a, b) in enumerate(zip(one, other), start=1):
        for key in ("loss", "gnorm"):
            assert relative_close(float(a[key]), float(b[key]), REL), f"update {step} {key}: {a[key]} vs {b[key]}"
    reference, got = valid_losses(logs[REFERENCE[name]]), valid_losses(logs[name])
    assert len(reference) == len(got) >= 2
    for x, y in zip(reference, got):
        assert relative_close(x, y, REL), (reference, got)
