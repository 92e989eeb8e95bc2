"""``--document-masking`` data: every block's ``document_ids`` number the documents its tokens come
from, checked against the document of each token of the concatenated documents (training stream
and held-out split, ``streaming_lm`` and ``streaming_mlm``)."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from data_prep import train_spm
from tests.helpers.stream_data import make_docs, write_index, write_shard
from tests.tasks.conftest import batches, build_task

T = 16


def corpus(tmp_path: Path, task: str):
    """One single-shard corpus (train = valid) and the task over it with ``--document-masking``."""
    docs = make_docs(5, seed=4)
    write_shard(tmp_path / "a.txt", docs)
    for split in ("train", "valid"):
        write_index(tmp_path, split, [{"source": ["a.txt"], "weight": 1.0}])
    if task == "streaming_mlm":
        train_spm.main([str(tmp_path), "--vocab-size", "60"])
    built = build_task(tmp_path, task, ("--document-masking",))
    encoded = [built.document_encoder()(doc) for doc in docs]
    return built, encoded


def owners(encoded: list[list[int]], passes: int) -> tuple[list[int], list[int]]:
    """The stream's tokens over ``passes`` passes and the running document number of each."""
    tokens = [t for _ in range(passes) for doc in encoded for t in doc]
    doc = [i for i, d in enumerate(encoded * passes) for _ in d]
    return tokens, doc


def relabel(rows: list[list[int]]) -> torch.Tensor:
    """Document numbers counted from each row's first."""
    return torch.tensor([[x - row[0] for x in row] for row in rows])


def held_out(task) -> list[dict]:
    task.load_dataset("valid")
    itr = task.get_batch_iterator(task.dataset("valid"), max_sentences=4).next_epoch_itr(shuffle=False)
    return list(itertools.islice(itr, 100))


def test_lm_blocks_number_their_documents(tmp_path: Path) -> None:
    task, encoded = corpus(tmp_path, "streaming_lm")
    samples, _ = batches(task, 6)
    tokens, doc = owners(encoded, 1 + 6 * 4 * T // sum(map(len, encoded)))
    for b, ids in enumerate(torch.cat([s["net_input"]["document_ids"] for s in samples])):
        # the target at position k is stream token b*T + k; its source token opens its document
        assert torch.equal(ids, relabel([doc[b * T : (b + 1) * T]])[0]), b
    assert torch.cat([s["target"] for s in samples]).flatten().tolist() == tokens[: 6 * 4 * T]
    plain, _ = batches(build_task(tmp_path, "streaming_lm"), 6)  # the flag changes no token, adds only the ids
    assert all("document_ids" not in p["net_input"] and torch.equal(p["net_input"]["src_tokens"],
                                                                   s["net_input"]["src_tokens"])
               for p, s in zip(plain, samples))
    one_pass = owners(encoded, 1)[1]
    valid = held_out(task)
    assert sum(len(s["id"]) for s in valid) == -(-len(one_pass) // T)
    for sample in valid:
        for row, i in zip(sample["net_input"]["document_ids"], sample["id"].tolist()):
            expected = relabel([one_pass[i * T : (i + 1) * T]])[0]
            assert torch.equal(row[: len(expected)], expected)
            assert (row[len(expected):] == expected[-1]).all()  # pads join the row's last document


def test_mlm_blocks_number_their_documents(tmp_path: Path) -> None:
    task, encoded = corpus(tmp_path, "streaming_mlm")
    samples, _ = batches(task, 6)
    step = T - 1  # <s> + 15 stream tokens; the <s> joins the first document
    _, doc = owners(encoded, 1 + 6 * 4 * step // sum(map(len, encoded)))
    for b, ids in enumerate(torch.cat([s["net_input"]["document_ids"] for s in samples])):
        assert torch.equal(ids, relabel([doc[b * step : b * step + 1] + doc[b * step : (b + 1) * step]])[0]), b
    one_pass = owners(encoded, 1)[1]
    for sample in held_out(task):
        for row, i in zip(sample["net_input"]["document_ids"], sample["id"].tolist()):
            part = one_pass[i * step : (i + 1) * step]
            expected = relabel([part[:1] + part])[0]
            assert torch.equal(row[: len(expected)], expected)
            assert (row[len(expected):] == expected[-1]).all()  # pads join the row's last document

