"""Epoch iterator over an :class:`LMBlockStream` whose ``state_dict`` holds the exact stream position.

An epoch is ``batches_per_epoch`` batches; the stream itself never restarts. Positions are
counted in batches handed to the trainer (not what the loader workers have prefetched): every
batch carries its reader's position after it.

The checkpoint is written by data-parallel rank 0 alone, yet every rank must resume with its
own next unseen batch. So every rank keeps a *snapshot* of all ranks' stream positions and
the number of batches it has handed out since (``behind``); the same on every rank, since all
ranks hand out batches in step. :meth:`StreamEpochBatchIterator.sync_positions` refreshes the
snapshot to the current positions with one ``all_gather_object`` over the data-parallel
group: ``fairseq-train`` calls it on every rank before each checkpoint save (fairseq's
``save_checkpoint`` calls ``TsTrainer.consolidate_optimizer`` on every rank), the iterator
itself at each epoch's last batch, and a single-process iterator in ``state_dict`` (no
communication). A checkpoint holds the snapshot and ``behind``; on resume each rank restores
its position from the snapshot and reads ``behind`` batches again, discarding them. Under
``fairseq-train`` ``behind`` is 0: the restart reads no batch again. A state taken on rank 0
alone without the collective (library use) reads up to an epoch again.

A mid-epoch checkpoint resumes only at the ``--batches-per-epoch`` it was saved with (a
one-line error otherwise); an epoch-end checkpoint resumes at any, the stream going on where
it stopped.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from fairseq.data.iterators import CountingIterator, EpochBatchIterating

from torchscale_fairseq.data.lm_stream import LMBlockStream
from torchscale_fairseq.errors import TsConfigError

logger = logging.getLogger(__name__)


def _gather_dp(mine: dict, dp_rank: int, known: list[dict], data_group: dist.ProcessGroup | None) -> list[dict]:
    """The stream state of every rank of ``data_group`` (only this rank's is refreshed without a process group).

    A collective: every data-parallel rank calls it at the same batch."""
    if len(known) == 1 or not dist.is_initialized():
        return [mine if r == dp_rank else state for r, state in enumerate(known)]
    out: list = [None] * len(known)
    dist.all_gather_object(out, mine, group=data_group)
    return out


class StreamEpochBatchIterator(EpochBatchIterating):
    """fairseq epoch iterator for the streaming tasks (resumable mid-shard); ``data_group``: the
    data-parallel group the positions are gathered over."""

    def __init__(self, dataset: LMBlockStream, num_workers: int, batches_per_epoch: int, epoch: int = 1,
                 data_group: dist.ProcessGroup | None = None) -> None:
        self.dataset = dataset
        self.data_group = data_group
        self.num_workers = num_workers
        self.batches_per_epoch = batches_per_epoch
        self.epoch = max(epoch, 1)
        self.shuffle = True
        self._rank_states = [{"readers": copy.deepcopy(dataset.states), "next_reader": 0}] * dataset.dp_size
        self._behind = 0  # batches handed out since the positions in ``_rank_states``
        self._position: dict | None = None  # this rank's position now (None until read up to it)
        self._cur_epoch_itr: CountingIterator | None = None
        self._source: Iterator[dict] | None = None
        self._resume_offset: int | None = None

    def __len__(self) -> int:
        return self.batches_per_epoch

    @property
    def next_epoch_idx(self) -> int:
        if self._resume_offset is not None:
            return self.epoch
        if self._cur_epoch_itr is not None and self.end_of_epoch():
            return self.epoch + 1
        return self.epoch

    def next_epoch_itr(self, shuffle: bool = True, fix_batches_to_gpus: bool = False,
                       set_dataset_epoch: bool = True) -> CountingIterator:
        self.epoch = self.next_epoch_idx
        offset, self._resume_offset = self._resume_offset or 0, None
        self.close()
        self._source = self._batches(self.batches_per_epoch - offset)
        self._cur_epoch_itr = CountingIterator(self._source, start=offset, total=self.batches_per_epoch)
        return self._cur_epoch_itr

    def end_of_epoch(self) -> bool:
        return self._cur_epoch_itr is not None and not self._cur_epoch_itr.has_next()

    @property
    def iterations_in_epoch(self) -> int:
        if self._cur_epoch_itr is not None:
            return self._cur_epoch_itr.n
        return self._resume_offset or 0

    def close(self) -> None:
        """Stop the loader workers of the current epoch (before forking new ones)."""
        if self._source is not None:
            self._source.close()
            self._source = None

    def sync_positions(self) -> None:
        """Refresh the snapshot to every rank's position after the batches handed out so far.

        A collective when data-parallel: every data-parallel rank calls it at the same batch."""
        if self._behind == 0 or self._position is None:
            return  # the snapshot is current, or not read up to yet (the same on every rank)
        self._rank_states = _gather_dp(copy.deepcopy(self._position), self.dataset.dp_rank, self._rank_states,
                                       self.data_group)
        self._behind = 0

    def _batches(self, n: int) -> Iterator[dict]:
        """This rank's next ``n`` batches, the last of them ending the epoch. Reading starts at the
        snapshot; the ``_behind`` batches already handed out since are read again and discarded."""
        mine = copy.deepcopy(self._rank_states[self.dataset.dp_rank])
        self.dataset.states = copy.deepcopy(mine["readers"])
        self.dataset.first = mine["next_reader"]
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=None, num_workers=self.num_workers, persistent_workers=False
        )
        it = iter(loader)

        def advance() -> dict:
            sample = next(it)
            local, state = sample.pop("stream_state")
            mine["readers"][local] = state
            mine["next_reader"] = (local + 1) % self.dataset.n_local
            return sample

        try:
            for _ in range(self._behind):
                advance()
            self._position = mine
            for i in range(n):
                sample = advance()
                self._behind += 1
                if i == n - 1:  # the epoch's last batch: every rank is here
                    self.sync_positions()
                yield sample
        finally:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def state_dict(self) -> dict:
        if self.dataset.dp_size == 1:
            self.sync_positions()
        if self.end_of_epoch():
            epoch, iterations = self.epoch + 1, 0
        else:
            epoch, iterations = self.epoch, self.iterations_in_epoch
        return {
            "version": 4,
            "epoch": epoch,
            "iterations_in_epoch": iterations,
            "shuffle": self.shuffle,
            "stream": {
                "layout": [self.dataset.dp_size, self.dataset.n_local, len(self.dataset.corpora)],
                "ranks": copy.deepcopy(self._rank_states),
                "behind": self._behind,
                "batches_per_epoch": self.batches_per_epoch,
            },
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        iterations = state_dict.get("iterations_in_epoch", 0)
        self._resume_offset = iterations if 0 < iterations < self.batches_per_epoch else None
        self.close()
        self._cur_epoch_itr = None
        stream = state_dict.get("stream")
        if stream is None:
            logger.warning("checkpoint has no stream position: the data stream starts from the beginning")
            return
        layout = [self.dataset.dp_size, self.dataset.n_local, len(self.dataset.corpora)]
        if list(stream["layout"]) != layout:
            raise TsConfigError(
                f"cannot resume the data stream: the checkpoint was written with data-parallel size, "
                f"readers (--num-workers) and corpora {list(stream['layout'])}, this run has {layout}; "
                "use the same settings, or --reset-dataloader to restart the stream"
            )
        saved_len = stream.get("batches_per_epoch")  # versions 2 and 3 did not record it
        if iterations and (iterations >= self.batches_per_epoch or saved_len not in (None, self.batches_per_epoch)):
            epoch = f"an epoch of {saved_len} batches" if saved_len else "an epoch"
            fix = f"--batches-per-epoch {saved_len}" if saved_len else "the --batches-per-epoch it was saved with"
            raise TsConfigError(
                f"cannot resume the data stream: the checkpoint was saved after batch {iterations} of {epoch}, "
                f"this run has --batches-per-epoch {self.batches_per_epoch}; resume with {fix} "
                "(it may change at an epoch-end checkpoint)"
            )
        self._rank_states = copy.deepcopy(stream["ranks"])
        self._behind = stream.get("behind", 0)  # version 2 held every rank's position at the batch itself
        self._position = None
        where = f"after batch {iterations} of epoch {self.epoch}" if iterations else f"at the start of epoch {self.epoch}"
        again = f"reading {self._behind} batch(es) again to reach it" if self._behind else "reading no batch again"
        logger.info("data stream resumes %s (%d per epoch), %s", where, self.batches_per_epoch, again)
