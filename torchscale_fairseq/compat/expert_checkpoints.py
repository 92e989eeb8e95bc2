"""One checkpoint shard per rank when experts are spread over ranks.

Stock fairseq saves on data-parallel rank 0 only and loads there then broadcasts, which
would lose (or overwrite) the other ranks' experts. For a model with expert parameters
in a multi-rank run every data-parallel rank saves ``<name><suffix>-shard<rank>.pt``
and loads its own shard; ``ts-consolidate-experts`` merges the shards into one file for
single-process ``fairseq-generate`` / ``fairseq-eval-lm``. The existing trainer
properties are wrapped, not replaced, so other patches keep working.
"""

from __future__ import annotations

import os

from fairseq.trainer import Trainer
from omegaconf import open_dict


def is_expert_sharded(trainer: Trainer) -> bool:
    if trainer.data_parallel_world_size <= 1:
        return False
    return any(getattr(p, "expert", False) for p in trainer.model.parameters())


def patch_trainer_expert_checkpoints() -> None:
    """Install the wrappers (idempotent)."""
    if getattr(Trainer, "_ts_expert_checkpoints", False):
        return
    should_save = Trainer.should_save_checkpoint_on_current_rank.fget
    suffix = Trainer.checkpoint_suffix.fget
    save = Trainer.save_checkpoint
    load = Trainer.load_checkpoint

    def should_save_checkpoint_on_current_rank(self) -> bool:
        return True if is_expert_sharded(self) else should_save(self)

    def checkpoint_suffix(self) -> str:
        base = suffix(self)
        return f"{base}-shard{self.data_parallel_rank}" if is_expert_sharded(self) else base

    def save_checkpoint(self, filename, extra_state):
        if is_expert_sharded(self):
            os.makedirs(os.path.dirname(os.path.abspath(filename)), exist_ok=True)
        return save(self, filename, extra_state)

    def load_checkpoint(self, filename, *args, **kwargs):
        if is_expert_sharded(self):
            with open_dict(self.cfg):
                self.cfg.checkpoint.load_checkpoint_on_all_dp_ranks = True
        return load(self, filename, *args, **kwargs)

    Trainer.should_save_checkpoint_on_current_rank = property(should_save_checkpoint_on_current_rank)
    Trainer.checkpoint_suffix = property(checkpoint_suffix)
    Trainer.save_checkpoint = save_checkpoint
    Trainer.load_checkpoint = load_checkpoint
    Trainer._ts_expert_checkpoints = True
