"""``streaming_mlm``: SentencePiece ids as fairseq's preprocessing path, span masking by its
formula, packed blocks that reassemble the stream, exact resume, and a ``ts_mlm`` training run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from fairseq.data.encoders.sentencepiece_bpe import SentencepieceBPE, SentencepieceConfig

from data_prep import train_spm
from tests.helpers.cli_utils import json_logs, last_error_line, run_many, tool
from tests.helpers.stream_data import make_docs, make_stream_data, write_index, write_shard
from tests.tasks.conftest import USER_DIR, batches
from torchscale_fairseq.data.span_masking import span_mask_positions

T = 16


def with_spm(data: Path) -> Path:
    train_spm.main([str(data), "--vocab-size", "60"])
    return data


def expected_counts(n: int, p: float, span: float) -> tuple[int, int]:
    """(masked tokens, spans) by the formula of the task's documentation."""
    m = min(max(round(n * p), 1), max(n - 1, 1))
    return m, min(max(round(m / span), 1), n - m + 1)


def runs(positions: list[int]) -> list[int]:
    """Lengths of the maximal runs of consecutive positions."""
    out: list[int] = []
    for i, p in enumerate(positions):
        if i and p == positions[i - 1] + 1:
            out[-1] += 1
        else:
            out.append(1)
    return out


@pytest.mark.parametrize("n", [1, 2, 5, 15, 64, 511])
@pytest.mark.parametrize("p,span", [(0.15, 3.0), (0.5, 1.0), (0.3, 10.0)])
def test_span_mask_counts_and_runs(n: int, p: float, span: float) -> None:
    rng = random.Random(n)
    for _ in range(20):
        pos = span_mask_positions(n, p, span, rng)
        m, k = expected_counts(n, p, span)
        assert pos == sorted(set(pos)) and all(0 <= q < n for q in pos)
        assert len(pos) == m and len(runs(pos)) == k


def test_span_lengths_average_span_length_and_cover_every_position() -> None:
    rng = random.Random(0)
    lengths, hits = [], [0] * 511
    for _ in range(400):
        pos = span_mask_positions(511, 0.15, 3.0, rng)
        lengths.extend(runs(pos))
        for q in pos:
            hits[q] += 1
    assert abs(sum(lengths) / len(lengths) - 3.0) < 0.05
    assert max(lengths) > 6 and min(hits) > 0  # random lengths, no position left out


def test_ids_match_fairseq_sentencepiece_path(tmp_path: Path, task_factory) -> None:
    make_stream_data(tmp_path, {"c": (1, 8, 1.0)})
    task = task_factory(with_spm(tmp_path), "streaming_mlm")
    bpe = SentencepieceBPE(SentencepieceConfig(sentencepiece_model=str(tmp_path / "spm.model")))
    docs = make_docs(8, seed=0, tag="cd") + [["Ωmega unseen ✓ chars"]]
    for doc in docs:
        ref = [t for line in doc for t in task.dictionary.encode_line(bpe.encode(line), add_if_not_exist=False)]
        assert task.document_encoder()(doc) == [*map(int, ref), task.dictionary.eos()]
    assert task.dictionary[len(task.dictionary) - 1] == "<mask>"
    assert task.dictionary.unk() in task.document_encoder()(docs[-1])


def test_blocks_reassemble_the_stream_and_masks_follow_the_formula(tmp_path: Path, task_factory) -> None:
    docs = make_docs(6, seed=3)
    write_shard(tmp_path / "a.txt", docs)
    write_index(tmp_path, "train", [{"source": ["a.txt"], "weight": 1.0}])
    task = task_factory(with_spm(tmp_path), "streaming_mlm")
    d = task.dictionary
    samples, _ = batches(task, 10)
    src = torch.cat([s["net_input"]["src_tokens"] for s in samples])
    tgt = torch.cat([s["target"] for s in samples])
    assert src.shape == tgt.shape == (40, T) and (src[:, 0] == d.bos()).all() and (tgt[:, 0] == d.pad()).all()
    masked = tgt.ne(d.pad())
    assert (src[masked] == task.mask_idx).all() and not (src[~masked] == task.mask_idx).any()
    m, k = expected_counts(T - 1, 0.15, 3.0)
    assert (masked.sum(1) == m).all()
    original = torch.where(masked, tgt, src)[:, 1:].reshape(-1).tolist()
    one_pass = [t for doc in docs for t in task.document_encoder()(doc)]
    assert original == (one_pass * (len(original) // len(one_pass) + 1))[: len(original)]
    assert len({tuple(row) for row in masked.tolist()}) > 10  # masks differ between blocks


def test_resume_masks_exactly_as_an_uninterrupted_run(tmp_path: Path, task_factory) -> None:
    make_stream_data(tmp_path, {"a": (2, 5, 2.0), "b": (1, 6, 1.0)})
    with_spm(tmp_path)
    full, _ = batches(task_factory(tmp_path, "streaming_mlm"), 7, 2)
    head, state = batches(task_factory(tmp_path, "streaming_mlm"), 3, 2)
    tail, _ = batches(task_factory(tmp_path, "streaming_mlm"), 4, 2, state=state)
    for a, b in zip(full, head + tail, strict=True):
        assert torch.equal(a["net_input"]["src_tokens"], b["net_input"]["src_tokens"])
        assert torch.equal(a["target"], b["target"])


def test_valid_split_masks_every_token_once_in_blocks(tmp_path: Path, task_factory) -> None:
    make_stream_data(tmp_path, {"c": (1, 4, 1.0)}, valid_docs=5)
    task = task_factory(with_spm(tmp_path), "streaming_mlm")
    task.load_dataset("valid")
    ds = task.dataset("valid")
    itr = task.get_batch_iterator(ds, max_sentences=3).next_epoch_itr(shuffle=False)
    rows = [(s, t) for b in itr for s, t in zip(b["net_input"]["src_tokens"].tolist(), b["target"].tolist())]
    pad = task.dictionary.pad()
    text = [t if t != pad else s for s, t in ((s, t) for src, tgt in rows for s, t in zip(src[1:], tgt[1:])) if s != pad]
    docs = make_docs(5, seed=999, tag="valid")
    assert text == [t for doc in docs for t in task.document_encoder()(doc)]


def test_bad_mask_options_and_missing_model(tmp_path: Path, task_factory) -> None:
    make_stream_data(tmp_path, {"c": (1, 4, 1.0)})
    with pytest.raises(ValueError, match=r"spm\.model does not exist; pass --spm-model"):
        task_factory(tmp_path, "streaming_mlm")
    (tmp_path / "spm.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="cannot be loaded"):
        task_factory(tmp_path, "streaming_mlm")
    (tmp_path / "spm.model").unlink()
    with_spm(tmp_path)
    with pytest.raises(ValueError, match=r"--mask-prob must be in \(0, 1\)"):
        task_factory(tmp_path, "streaming_mlm", ("--mask-prob", "0"))
    with pytest.raises(ValueError, match="--span-length must be at least 1"):
        task_factory(tmp_path, "streaming_mlm", ("--span-length", "0.5"))


def test_train_spm_never_overwrites(tmp_path: Path) -> None:
    make_stream_data(tmp_path, {"c": (1, 4, 1.0)})
    with_spm(tmp_path)
    before = (tmp_path / "spm.model").read_bytes()
    with pytest.raises(SystemExit, match="exists; pass --force"):
        with_spm(tmp_path)
    assert (tmp_path / "spm.model").read_bytes() == before


def test_fairseq_train_ts_mlm_on_the_stream(tmp_path: Path) -> None:
    """A training run, and beside it (``run_many``) the same command on the same stream without its
    ``spm.model``, refused in one line."""
    corpora = {"a": (2, 20, 1.0), "b": (1, 20, 0.5)}
    data, no_model = (make_stream_data(tmp_path / name, corpora, valid_docs=10) for name in ("data", "no-model"))
    with_spm(data)

    def train(root: Path) -> list:
        return [tool("fairseq-train"), root, "--user-dir", USER_DIR, "--task", "streaming_mlm", "--arch", "ts_mlm_tiny",
                "--criterion", "masked_lm", "--tokens-per-sample", "32", "--optimizer", "adam", "--lr", "1e-3",
                "--batch-size", "4", "--batches-per-epoch", "3", "--max-update", "6", "--num-workers", "2", "--cpu",
                "--save-dir", root / "ck", "--no-epoch-checkpoints", "--log-format", "json", "--log-interval", "1"]

    proc, bad = run_many([train(data), train(no_model)], check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    log = proc.stderr + proc.stdout
    train_log, valid = json_logs(log, "train_inner"), json_logs(log, "valid")
    assert len(train_log) == 6 and all(0 < float(r["loss"]) < 20 for r in train_log)
    assert len(valid) == 2 and all(float(r["valid_loss"]) > 0 for r in valid)
    assert (data / "ck" / "checkpoint_last.pt").is_file()
    assert bad.returncode != 0 and "spm.model does not exist" in last_error_line(bad)
