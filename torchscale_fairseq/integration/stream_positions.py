"""Checkpoints of the streaming tasks hold every data-parallel rank's stream position at the save.

fairseq's ``save_checkpoint`` runs on every rank, but only data-parallel rank 0 writes; so
first every rank refreshes the streaming iterator's snapshot of all ranks' positions
(:meth:`~torchscale_fairseq.data.stream_iterator.StreamEpochBatchIterator.sync_positions`,
one ``all_gather_object`` per save), and a restart reads no batch again. Other epoch
iterators are saved as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torchscale_fairseq.data.stream_iterator import StreamEpochBatchIterator


def wrap_save_checkpoint(save_checkpoint: Callable) -> Callable:
    """fairseq's ``checkpoint_utils.save_checkpoint``, with the stream positions gathered first."""

    @functools.wraps(save_checkpoint)
    def wrapped(cfg, trainer, epoch_itr, val_loss):
        if not cfg.no_save and isinstance(epoch_itr, StreamEpochBatchIterator):
            epoch_itr.sync_positions()  # on every rank, at the same update
        return save_checkpoint(cfg, trainer, epoch_itr, val_loss)

    return wrapped
