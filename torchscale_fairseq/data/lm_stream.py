"""The streaming tasks' training stream: raw-text shards -> ids -> packed blocks -> batches.

Each corpus is an endless sequence of documents (passes over its shards, shard order
reshuffled every pass), turned into ids by a document encoder
(:mod:`torchscale_fairseq.data.document_encoders`: ``ids(line) + </s>`` per line, then
``</s>``, as the ``data_prep`` LM stream where a blank line is a lone ``</s>``). Reader
``g`` of ``G`` (``G`` = data-parallel size x loader workers) reads, of each pass, the
shards at positions ``g`` mod ``G`` of the pass order when the corpus has at least ``G``
shards (as TorchScale's infinibatch loader: no reader opens another's shards), otherwise
every shard but only the documents whose running number in the pass is ``g`` mod ``G``;
either way the readers are disjoint and together complete. Every block is
``tokens_per_sample`` target tokens, no padding; its source is the same tokens shifted
right by one (as fairseq's ``TokenBlockDataset``). The corpus of each
block is drawn by weight from a seed fixed by (seed, reader, block number).

All positions are plain dicts (:class:`Cursor` fields), so the exact stream position can be
saved in a checkpoint and resumed mid-document.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
from fairseq.data import BaseWrapperDataset, FairseqDataset

from torchscale_fairseq.data.stream_index import Corpus
from torchscale_fairseq.data.text_shards import ShardReader
from torchscale_fairseq.errors import TsConfigError

logger = logging.getLogger(__name__)

DocumentEncoder = Callable[[Sequence[str]], list[int]]


def too_few_documents(corpus: Corpus, count: int, n_readers: int) -> TsConfigError:
    return TsConfigError(
        f"corpus {corpus.name!r} has {count} document(s), fewer than the {n_readers} readers "
        "(data-parallel size x --num-workers): add text or use fewer --num-workers"
    )


def check_documents_per_reader(corpora: Sequence[Corpus], n_readers: int) -> None:
    """Every reader gets documents: a corpus with fewer shards than readers needs at least
    ``n_readers`` documents (counting stops there)."""
    for corpus in corpora:
        if len(corpus.shards) >= n_readers:
            continue
        docs = (doc for shard in corpus.shards for doc in ShardReader(shard))
        count = sum(1 for _ in itertools.islice(docs, n_readers))
        if count < n_readers:
            raise too_few_documents(corpus, count, n_readers)


def held_out_documents(corpora: Sequence[Corpus], encode: DocumentEncoder) -> list[list[int]]:
    """The ids of every document of ``corpora`` once, in index order (for validation)."""
    docs = []
    for corpus in corpora:
        for shard in corpus.shards:
            reader = ShardReader(shard)
            docs.extend(encode(doc.lines) for doc in reader)
            if reader.bad_bytes:
                logger.warning("skipped %d undecodable byte(s) in %s", reader.bad_bytes, shard)
    return docs


class DocumentIdsDataset(BaseWrapperDataset):
    """fairseq LM blocks (``MonolingualDataset`` over ``TokenBlockDataset``, break mode ``none``) whose
    batches carry ``document_ids``; ``begins`` holds, per block, a 0/1 tensor aligned with its targets,
    1 where a document's first token is (the same blocking over per-document ``[1, 0, ..., 0]``)."""

    def __init__(self, blocks: FairseqDataset, begins: FairseqDataset) -> None:
        super().__init__(blocks)
        self.begins = begins

    def __getitem__(self, index: int) -> dict:
        return {**self.dataset[index], "begins": self.begins[index]}

    def collater(self, samples: list[dict]) -> dict:
        batch = self.dataset.collater(samples)
        if batch:
            length = batch["net_input"]["src_tokens"].size(1)
            starts = [s["begins"].nonzero().flatten().tolist() for s in samples]
            batch["net_input"]["document_ids"] = document_ids(starts, length)
        return batch


@dataclass
class Cursor:
    """Position of one reader in one corpus: the current document and how much of it was used."""

    epoch_pass: int = 0
    shard: int = 0
    offset: int = 0
    doc: int = 0
    tok: int = 0
    prev: int = -1


def shard_order(n_shards: int, seed: int, corpus: int, epoch_pass: int) -> list[int]:
    """The shard order of one pass over a corpus (a seeded permutation)."""
    order = list(range(n_shards))
    random.Random(f"{seed}:{corpus}:{epoch_pass}").shuffle(order)
    return order


class CorpusStream:
    """Documents of one corpus for one reader, packed into blocks of ``length + 1`` tokens."""

    def __init__(self, corpus: Corpus, index: int, seed: int, reader: int, n_readers: int,
                 cursor: Cursor, encode: DocumentEncoder, eos: int) -> None:
        self.corpus, self.index, self.seed = corpus, index, seed
        self.reader, self.n_readers = reader, n_readers
        self.encode = encode
        self.cursor = copy.copy(cursor)
        if self.cursor.prev < 0:
            self.cursor.prev = eos
        self._ids: list[int] | None = None
        self._docs = self.documents()

    def documents(self) -> Iterator[tuple[int, int, int, int, list[int]]]:
        """(pass, shard position, byte offset, document number, ids) of this reader's documents from the cursor."""
        c = self.cursor
        epoch_pass, shard, offset, doc = c.epoch_pass, c.shard, c.offset, c.doc
        by_shard = len(self.corpus.shards) >= self.n_readers
        while True:
            order = shard_order(len(self.corpus.shards), self.seed, self.index, epoch_pass)
            while shard < len(order):
                if by_shard and shard % self.n_readers != self.reader:
                    shard, offset = shard + 1, 0
                    continue
                path = self.corpus.shards[order[shard]]
                reader = ShardReader(path, offset)
                for raw in reader:
                    if by_shard or doc % self.n_readers == self.reader:
                        yield epoch_pass, shard, raw.offset, doc, self.encode(raw.lines)
                    doc += 1
                if reader.bad_bytes:
                    logger.warning("skipped %d undecodable byte(s) in %s", reader.bad_bytes, path)
                shard, offset = shard + 1, 0
            if not by_shard and doc <= self.reader:  # documents are numbered 0 .. doc - 1 in each pass
                raise too_few_documents(self.corpus, doc, self.n_readers)
            epoch_pass, shard, doc = epoch_pass + 1, 0, 0

    def next_block(self, length: int) -> tuple[list[int], list[int]]:
        """``length + 1`` tokens: the token before the block, then the block; and the indices
        (into those tokens) where a document begins."""
        c = self.cursor
        out, starts = [c.prev], []
        while len(out) <= length:
            if self._ids is None or c.tok >= len(self._ids):
                resume_tok = c.tok if self._ids is None else 0
                c.epoch_pass, c.shard, c.offset, c.doc, self._ids = next(self._docs)
                c.tok = min(resume_tok, len(self._ids))
                if c.tok == 0:
                    starts.append(len(out))
                continue
            take = min(length + 1 - len(out), len(self._ids) - c.tok)
            out.extend(self._ids[c.tok : c.tok + take])
            c.tok += take
        c.prev = out[-1]
        return out, starts


def document_ids(starts: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    """``(B, length)`` document numbers: row ``b`` counts the ``starts[b]`` (token positions where
    a document begins) at or before each position; position 0 opens the block's first document."""
    begins = torch.zeros(len(starts), length, dtype=torch.long)
    begins[:, 0] = 1
    for row, positions in enumerate(starts):
        begins[row, [p for p in positions if 0 < p < length]] = 1
    return begins.cumsum(1) - 1


def initial_reader_state(n_corpora: int) -> dict:
    """The state of a reader that has not read anything."""
    return {"blocks": 0, "cursors": [asdict(Cursor()) for _ in range(n_corpora)]}


class LMBlockStream(torch.utils.data.IterableDataset):
    """Batches of packed LM blocks for one data-parallel rank, read by ``n_local`` readers.

    Local reader ``r`` (``0 <= r < n_local``) is global reader ``dp_rank * n_local + r``.
    Loader worker ``w`` of ``n_local`` workers runs local reader ``(first + w) % n_local``,
    starting from ``states[r]``; every batch carries ``stream_state = (r, state after it)``.
    Each block takes ``block_tokens`` new tokens from the stream (:meth:`collate` makes the
    sample; subclasses change both for other objectives). With ``document_masking`` the
    sample's ``net_input`` carries ``document_ids`` (:func:`document_ids`).
    """

    def __init__(self, corpora: Sequence[Corpus], tokens_per_sample: int, batch_size: int, encode: DocumentEncoder,
                 eos: int, seed: int, dp_rank: int, dp_size: int, n_local: int, document_masking: bool = False) -> None:
        super().__init__()
        self.document_masking = document_masking
        self.corpora = list(corpora)
        self.tokens_per_sample, self.batch_size = tokens_per_sample, batch_size
        self.block_tokens = tokens_per_sample
        self.encode, self.eos, self.seed = encode, eos, seed
        self.dp_rank, self.dp_size, self.n_local = dp_rank, dp_size, n_local
        self.states = [initial_reader_state(len(self.corpora)) for _ in range(n_local)]
        self.first = 0
        total = sum(c.weight for c in self.corpora)
        self._cum = [sum(c.weight for c in self.corpora[: i + 1]) / total for i in range(len(self.corpora))]

    def _pick_corpus(self, reader: int, block: int) -> int:
        if len(self.corpora) == 1:
            return 0
        u = random.Random((self.seed * 1_000_003 + reader) * 1_000_000_007 + block).random()
        return min(bisect.bisect_right(self._cum, u), len(self.corpora) - 1)

    def reader_batches(self, local: int) -> Iterator[dict]:
        """Endless batches of local reader ``local`` from its saved state."""
        g, n_readers = self.dp_rank * self.n_local + local, self.dp_size * self.n_local
        state = copy.deepcopy(self.states[local])
        streams = [
            CorpusStream(c, i, self.seed, g, n_readers, Cursor(**state["cursors"][i]), self.encode, self.eos)
            for i, c in enumerate(self.corpora)
        ]
        blocks = state["blocks"]
        while True:
            rows, starts = [], []
            for _ in range(self.batch_size):
                row, row_starts = streams[self._pick_corpus(g, blocks)].next_block(self.block_tokens)
                rows.append(row)
                starts.append(row_starts)
                blocks += 1
            after = {"blocks": blocks, "cursors": [asdict(s.cursor) for s in streams]}
            yield self.collate(rows, starts, blocks - len(rows), g, (local, after))

    def sample_ids(self, first_block: int, n: int, reader: int) -> torch.Tensor:
        """Stream-wide sample ids: block number x readers + reader."""
        return torch.arange(first_block, first_block + n) * (self.dp_size * self.n_local) + reader

    def collate(self, rows: list[list[int]], starts: list[list[int]], first_block: int, reader: int,
                state: tuple[int, dict]) -> dict:
        """A fairseq LM sample (source = block shifted right by one) plus its ``stream_state``.

        ``rows`` hold ``block_tokens + 1`` ids: the token before the block, then the block;
        ``starts`` where documents begin in them. A document's first target sits at source position
        ``start - 1``, whose token (the previous document's final ``</s>``) opens the document, as
        ``</s>`` opens a document run alone."""
        tokens = torch.tensor(rows, dtype=torch.long)
        bsz, length = len(rows), self.tokens_per_sample
        net_input = {"src_tokens": tokens[:, :-1].contiguous(), "src_lengths": torch.full((bsz,), length)}
        if self.document_masking:
            net_input["document_ids"] = document_ids([[p - 1 for p in row] for row in starts], length)
        return {
            "id": self.sample_ids(first_block, bsz, reader),
            "nsentences": bsz,
            "ntokens": bsz * length,
            "net_input": net_input,
            "target": tokens[:, 1:].contiguous(),
            "stream_state": state,
        }

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if n_workers != self.n_local:
            raise RuntimeError(f"{type(self).__name__} built for {self.n_local} reader(s) runs in {n_workers} worker(s)")
        return self.reader_batches((self.first + worker) % self.n_local)
