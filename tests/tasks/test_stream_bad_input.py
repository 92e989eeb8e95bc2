"""``streaming_lm`` bad input: one-line :class:`TsConfigError` naming the file, before training starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli_utils import last_error_line, run_many, tool
from tests.helpers.stream_data import make_stream_data, write_index, write_shard
from tests.tasks.conftest import USER_DIR
from torchscale_fairseq.data import gpt2_bpe
from torchscale_fairseq.data.stream_index import load_index
from torchscale_fairseq.errors import TsConfigError


def _load(task_factory, data: Path) -> None:
    task_factory(data).load_dataset("train")


@pytest.mark.parametrize(
    "index_text, message",
    [
        ("[{\"source\": [\"a.txt\"], ", "is not valid JSON"),
        ("{\"source\": [\"a.txt\"]}", "must be a non-empty JSON list"),
        ("[]", "must be a non-empty JSON list"),
        ("[{\"weight\": 1}]", "'source' must be a non-empty list"),
        ("[{\"source\": [\"a.txt\"], \"weight\": -1}]", "must not be negative"),
        ("[{\"source\": [\"a.txt\"], \"weight\": \"heavy\"}]", "must be a finite number"),
        ("[{\"source\": [\"a.txt\"], \"weight\": 0}]", "must sum to a positive number"),
    ],
)
def test_index_errors(tmp_path: Path, index_text: str, message: str) -> None:
    write_shard(tmp_path / "a.txt", [["some text"]])
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "train.json").write_text(index_text)
    with pytest.raises(TsConfigError, match=message) as err:
        load_index(str(tmp_path), "train")
    assert str(tmp_path / "json" / "train.json") in str(err.value) and "\n" not in str(err.value)


def test_missing_index(tmp_path: Path, task_factory) -> None:
    with pytest.raises(TsConfigError, match=r"stream index .*train.json does not exist"):
        _load(task_factory, tmp_path)


@pytest.mark.parametrize("problem", ["missing", "empty", "blank", "unreadable"])
def test_shard_errors(tmp_path: Path, problem: str) -> None:
    write_shard(tmp_path / "good.txt", [["text"]])
    bad = tmp_path / "bad.txt"
    if problem == "empty":
        bad.write_text("")
    elif problem == "blank":
        bad.write_text("\n  \n\n")
    elif problem == "unreadable":
        bad.mkdir()  # a path that exists but cannot be read as a file, even by root
    write_index(tmp_path, "valid", [{"source": ["good.txt", "bad.txt"], "weight": 1}])
    expected = {"missing": "does not exist", "empty": "is empty", "blank": "is empty", "unreadable": "is unreadable"}
    with pytest.raises(TsConfigError, match=expected[problem]) as err:
        load_index(str(tmp_path), "valid")
    assert f"shard {bad} listed in" in str(err.value)


def test_missing_tokenizer_asset(tmp_path: Path, task_factory, monkeypatch) -> None:
    make_stream_data(tmp_path, {"c": (1, 2, 1.0)})
    monkeypatch.setattr(gpt2_bpe, "find_gpt2_ranks_file", lambda: tmp_path / "nowhere" / "gpt2.tiktoken")
    gpt2_bpe.get_gpt2_encoding.cache_clear()
    try:
        with pytest.raises(TsConfigError, match=r"ranks file .*nowhere/gpt2.tiktoken is missing"):
            _load(task_factory, tmp_path)
    finally:
        monkeypatch.undo()
        gpt2_bpe.get_gpt2_encoding.cache_clear()


def _train(data: Path, *extra: str) -> list:
    return [tool("fairseq-train"), data, "--user-dir", USER_DIR, "--task", "streaming_lm", "--arch", "ts_lm_tiny",
            "--batch-size", "2", "--tokens-per-sample", "16", "--cpu", "--max-update", "1", "--optimizer", "adam",
            "--save-dir", data / "ck", *extra]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict:
    """``fairseq-train`` on a stream with a missing shard and on one with fewer documents than readers,
    run side by side (``run_many``)."""
    missing = make_stream_data(tmp_path_factory.mktemp("missing_shard"), {"c": (2, 3, 1.0)})
    (missing / "shard" / "c" / "00001.txt").unlink()
    few = make_stream_data(tmp_path_factory.mktemp("few_documents"), {"c": (1, 2, 1.0)})
    procs = run_many([_train(missing), _train(few, "--num-workers", "3")], check=False)
    return {"missing_shard": (missing, procs[0]), "few_documents": procs[1]}


def test_cli_one_line_error_before_training(refused) -> None:
    data, proc = refused["missing_shard"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last_error_line(proc).startswith("fairseq-train: error: shard ")
    assert "00001.txt listed in" in last_error_line(proc) and "Traceback" not in proc.stderr
    assert not (data / "ck").exists() or not any((data / "ck").iterdir())


def test_cli_fewer_documents_than_readers_is_one_line(refused) -> None:
    proc = refused["few_documents"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last_error_line(proc) == (
        "fairseq-train: error: corpus 'c' has 2 document(s), fewer than the 3 readers (data-parallel size x "
        "--num-workers): add text or use fewer --num-workers"
    )
