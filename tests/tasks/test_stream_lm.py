"""``streaming_lm``: packing, data-parallel sharding, tensor-parallel equality, resume, mixing, held-out data."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.stream_data import make_docs, make_stream_data, write_index, write_shard
from tests.tasks.conftest import batches
from torchscale_fairseq.data import gpt2_bpe
from torchscale_fairseq.data.document_encoders import GPT2Documents
from torchscale_fairseq.data.lm_stream import CorpusStream, Cursor, shard_order
from torchscale_fairseq.data.stream_index import load_index
from torchscale_fairseq.data.text_shards import ShardReader
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.tasks import streaming

EOS, OFFSET, T = 2, 4, 16
document_ids = GPT2Documents(EOS, OFFSET)


def stream_of(docs: list[list[str]]) -> list[int]:
    return [t for doc in docs for t in document_ids(doc)]


def test_blocks_pack_documents_without_padding(tmp_path: Path, task_factory) -> None:
    docs = make_docs(5, seed=1)
    write_shard(tmp_path / "a.txt", docs)
    write_index(tmp_path, "train", [{"source": ["a.txt"], "weight": 1.0}])
    samples, _ = batches(task_factory(tmp_path), 12)
    src = torch.cat([s["net_input"]["src_tokens"] for s in samples])
    tgt = torch.cat([s["target"] for s in samples])
    assert src.shape[1] == T and tgt.shape[1] == T and not (tgt == 1).any()
    flat = tgt.reshape(-1).tolist()
    one_pass = stream_of(docs)
    expected = (one_pass * (len(flat) // len(one_pass) + 1))[: len(flat)]
    assert len(flat) > 2 * len(one_pass) and flat == expected  # wraps around the corpus, no gaps
    assert src.reshape(-1).tolist() == [EOS] + flat[:-1]  # source = target shifted right across blocks
    assert one_pass[-2:] == [EOS, EOS]  # line end, then end of document


def test_documents_match_gpt2_ids() -> None:
    line = "Hello world, café naïve"
    ids = document_ids([line, "second"])
    enc = gpt2_bpe.get_gpt2_encoding()
    first, second = ([i + 4 for i in enc.encode_ordinary(text)] for text in (line, "second"))
    assert ids == first + [EOS] + second + [EOS, EOS]


@pytest.mark.parametrize("n_shards,n_docs,n_readers", [(3, 7, 4), (5, 3, 2), (4, 1, 4)],
                         ids=["by-document", "by-shard", "by-shard-one-document-each"])
def test_readers_disjoint_and_complete(tmp_path: Path, n_shards: int, n_docs: int, n_readers: int) -> None:
    make_stream_data(tmp_path, {"c": (n_shards, n_docs, 1.0)})
    corpus = load_index(str(tmp_path), "train")[0]
    every = {(shard, doc.offset) for shard in corpus.shards for doc in ShardReader(shard)}
    order = shard_order(len(corpus.shards), 1, 0, 0)
    seen = []  # readers = data-parallel size x loader workers
    for reader in range(n_readers):
        stream = CorpusStream(corpus, 0, 1, reader, n_readers, Cursor(), document_ids, EOS)
        mine = set()
        for epoch_pass, shard, offset, _, _ in stream.documents():
            if epoch_pass > 0:
                break
            mine.add((corpus.shards[order[shard]], offset))
        seen.append(mine)
    assert all(seen) and sum(len(s) for s in seen) == len(every) == n_shards * n_docs
    assert set().union(*seen) == every
    shards_read = [{path for path, _ in mine} for mine in seen]
    if n_shards >= n_readers:  # no reader opens another reader's shard
        assert sum(len(s) for s in shards_read) == n_shards


def test_more_readers_than_documents_is_an_error(tmp_path: Path) -> None:
    make_stream_data(tmp_path, {"c": (1, 2, 1.0)})
    corpus = load_index(str(tmp_path), "train")[0]
    stream = CorpusStream(corpus, 0, 1, 3, 4, Cursor(), document_ids, EOS)
    with pytest.raises(ValueError, match="has 2 document.* fewer than the 4 readers"):
        stream.next_block(T)


def test_tensor_parallel_ranks_identical_data_parallel_ranks_differ(tmp_path: Path, task_factory, monkeypatch) -> None:
    make_stream_data(tmp_path, {"c": (2, 9, 1.0)})

    def run(dp_rank: int) -> list[torch.Tensor]:
        rank_of_two = ParallelContext(2, dp_rank, (dp_rank,), (0, 1), (dp_rank,), (dp_rank,))
        monkeypatch.setattr(streaming, "current_parallel_context", lambda: rank_of_two)
        samples, _ = batches(task_factory(tmp_path), 4)
        return [s["target"] for s in samples]

    tp0, tp1, other = run(1), run(1), run(0)
    assert all(torch.equal(a, b) for a, b in zip(tp0, tp1))
    assert not any(torch.equal(a, b) for a, b in zip(tp0, other))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_with_next_unseen_batch(tmp_path: Path, task_factory, num_workers: int) -> None:
    make_stream_data(tmp_path, {"a": (2, 5, 2.0), "b": (1, 6, 1.0)})
    full, _ = batches(task_factory(tmp_path), 9, num_workers)
    head, state = batches(task_factory(tmp_path), 4, num_workers)
    cursors = [c for r in state["stream"]["ranks"][0]["readers"] for c in r["cursors"]]
    assert any(c["tok"] > 0 for c in cursors)  # stopped mid-document
    state = torch.load(_save(tmp_path, state), weights_only=True)
    tail, _ = batches(task_factory(tmp_path), 5, num_workers, state=state)
    got = [s["target"] for s in head + tail]
    assert all(torch.equal(a["target"], b) for a, b in zip(full, got)) and len(got) == 9
    assert state["epoch"] == 2 and state["iterations_in_epoch"] == 1


def test_resume_from_a_version_2_state(tmp_path: Path, task_factory) -> None:
    """A state written before the per-epoch snapshot (version 2: every rank's position at the
    saved batch itself, no ``behind``) still resumes with the next unseen batch."""
    make_stream_data(tmp_path, {"a": (2, 5, 2.0), "b": (1, 6, 1.0)})
    full, _ = batches(task_factory(tmp_path), 6)
    head, state = batches(task_factory(tmp_path), 4, epoch_len=4)  # an epoch end: positions after batch 4
    assert state["stream"].pop("behind") == 0 and state["stream"].pop("batches_per_epoch") == 4
    state.update(version=2, epoch=2, iterations_in_epoch=1)  # batch 4 as the 1st of epoch 2 at 3 per epoch
    tail, _ = batches(task_factory(tmp_path), 2, state=state)
    got = [s["target"] for s in head + tail]
    assert all(torch.equal(a["target"], b) for a, b in zip(full, got)) and len(got) == 6


def _save(tmp_path: Path, state: dict) -> Path:
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def test_weighted_mixing_proportions(tmp_path: Path, task_factory) -> None:
    write_shard(tmp_path / "a.txt", [[" ".join(["apple"] * (3 + i % 5))] for i in range(30)])
    write_shard(tmp_path / "b.txt", [[" ".join(["zebra"] * (3 + i % 7))] for i in range(30)])
    write_index(tmp_path, "train", [{"source": ["a.txt"], "weight": 3}, {"source": ["b.txt"], "weight": 1}])
    apple = set(i + OFFSET for i in gpt2_bpe.encode("apple apple")) - {EOS}
    samples, _ = batches(task_factory(tmp_path), 500, epoch_len=500)
    blocks = torch.cat([s["target"] for s in samples])
    from_a = sum(bool(set(row.tolist()) & apple) for row in blocks)
    assert abs(from_a / len(blocks) - 0.75) < 0.04


def test_undecodable_bytes_skipped_with_warning(tmp_path: Path, task_factory, caplog) -> None:
    (tmp_path / "a.txt").write_bytes(b"good line \xff\xfeend\n\nsecond doc\n")
    write_index(tmp_path, "train", [{"source": ["a.txt"]}])
    with caplog.at_level(logging.WARNING):
        samples, _ = batches(task_factory(tmp_path), 1)
    flat = samples[0]["target"].reshape(-1).tolist()
    one_pass = stream_of([["good line end"], ["second doc"]])
    assert flat == (one_pass * 10)[: len(flat)]
    assert "skipped 2 undecodable byte(s)" in caplog.text


def test_valid_split_holds_every_token_once(tmp_path: Path, task_factory) -> None:
    make_stream_data(tmp_path, {"c": (1, 3, 1.0)}, valid_docs=7)
    task = task_factory(tmp_path)
    task.load_dataset("valid")
    ds = task.dataset("valid")
    tokens = torch.cat([ds[i]["target"] for i in range(len(ds))]).tolist()
    docs = [doc.lines for doc in ShardReader(str(tmp_path / "shard" / "valid" / "00000.txt"))]
    assert tokens == stream_of(docs) and len(docs) == 7


def test_data_parallel_resume_from_rank0_state_without_per_batch_gathers(tmp_path: Path, repo_root: Path) -> None:
    """Two gloo ranks: a checkpoint state taken on rank 0 alone, mid-epoch, resumes *each* rank
    with its own next unseen batch; the positions are gathered once per epoch, not per batch."""
    from tests.helpers.cli_utils import run
    from tests.helpers.rendezvous import rendezvous_url
    from tests.workers import dp_resume_worker as worker

    make_stream_data(tmp_path, {"a": (2, 5, 2.0), "b": (1, 6, 1.0)})
    out = tmp_path / "result"
    run([sys.executable, "-m", "tests.workers.dp_resume_worker", tmp_path, out, rendezvous_url(tmp_path)], cwd=repo_root)
    results = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(worker.WORLD)]
    for result in results:
        assert len(result["resumed"]) == len(result["full"]) == worker.FULL
        assert all(torch.equal(a, b) for a, b in zip(result["full"], result["resumed"]))
        assert result["gathers"] == worker.FULL // worker.EPOCH_LEN  # one per completed epoch
    assert not any(torch.equal(a, b) for a, b in zip(results[0]["full"], results[1]["full"]))  # ranks differ
