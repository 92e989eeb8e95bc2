"""Where ``fairseq-train`` gathers the streaming positions: ``TsTrainer.consolidate_optimizer``,
which fairseq's ``save_checkpoint`` calls on every rank before data-parallel rank 0 takes the
iterator's state (the resume it makes exact: ``test_stream_resume.py``). fairseq also calls it
inside a step's exception handler, on the failing rank alone, before writing ``crash.pt``
without the iterator: there it must start no collective (the other ranks would never join)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from tests.helpers.stream_data import make_stream_data
from torchscale_fairseq.integration.trainer import TsTrainer


def test_save_gathers_stream_positions_and_a_crash_does_not(tmp_path: Path, task_factory, monkeypatch) -> None:
    make_stream_data(tmp_path, {"a": (2, 5, 2.0)})
    task = task_factory(tmp_path)
    task.load_dataset("train")
    iterator = task.get_batch_iterator(task.dataset("train"), max_sentences=4)
    gathered = []
    monkeypatch.setattr(iterator, "sync_positions", lambda: gathered.append("sync"))
    trainer = TsTrainer.__new__(TsTrainer)  # what consolidate_optimizer reads: the config, the sharding, the iterator
    trainer.cfg = OmegaConf.create({"checkpoint": {"no_save_optimizer_state": True}})
    trainer.fully_sharded = False  # --zero-sharding full's gather is test_fully_sharded's
    trainer.device_skips = None  # --ts-sync-free-step's report at a save is test_sync_free_step's
    trainer._train_iterator = iterator

    trainer.consolidate_optimizer()  # as in save_checkpoint
    assert gathered == ["sync"]
    try:
        raise RuntimeError("a step failed on this rank")
    except RuntimeError:
        trainer.consolidate_optimizer()  # as in Trainer.train_step's handler, before crash.pt
    assert gathered == ["sync"]
