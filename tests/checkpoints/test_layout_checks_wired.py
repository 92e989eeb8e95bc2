"""The layout checks where fairseq meets a checkpoint: the trainer refuses to start fresh
when its own file is missing but the checkpoint was saved with another layout, and
fairseq's loader refuses one expert shard given to a process that uses another number of
shards (a single-process ``fairseq-eval-lm`` or ``fairseq-generate``)."""

from __future__ import annotations

import pytest
import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from tests.helpers.cli_utils import USER_DIR
from torchscale_fairseq.checkpoints.layout import EXPERT_RECORD_KEY, RECORD_KEY
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.trainer import TsTrainer


def _trainer(lm_data, save_dir) -> TsTrainer:
    argv = [str(lm_data), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_tiny", "--cpu",
            "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2",
            "--decoder-layers", "2", "--tokens-per-sample", "16", "--moe-expert-count", "2",
            "--criterion", "moe_cross_entropy", "--optimizer", "adam", "--save-dir", str(save_dir)]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    return TsTrainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))


def test_missing_own_file_of_a_sharded_checkpoint_is_one_line(lm_data, tmp_path):
    trainer = _trainer(lm_data, tmp_path)
    for r in range(2):
        (tmp_path / f"checkpoint_last-shard{r}.pt").write_bytes(b"")  # found by name; never read
    with pytest.raises(TsConfigError, match=r"does not exist but .*checkpoint_last\.pt was saved as 1 tensor-parallel "
                                            r"part\(s\) x 1 pipeline stage\(s\) x 2 expert shard\(s\)"):
        trainer.load_checkpoint(str(tmp_path / "checkpoint_last.pt"))
    assert trainer.load_checkpoint(str(tmp_path / "checkpoint_other.pt")) is None  # nothing saved: a fresh start


def test_one_expert_shard_in_a_single_process_names_the_consolidation(lm_data, tmp_path):
    trainer = _trainer(lm_data, tmp_path)
    path = str(tmp_path / "checkpoint_1_1.pt")
    trainer.consolidate_optimizer()  # as fairseq's save_checkpoint does first
    trainer.save_checkpoint(path, {})
    assert checkpoint_utils.load_checkpoint_to_cpu(path)["model"]  # one shard of one: loads
    state = torch.load(path, weights_only=False)
    state["extra_state"][RECORD_KEY][EXPERT_RECORD_KEY].update(size=2, rank=1)  # as rank 1 of 2 saves it
    torch.save(state, path)
    with pytest.raises(TsConfigError, match="ts-consolidate-experts"):
        checkpoint_utils.load_checkpoint_to_cpu(path)


def test_optimizer_state_recorded_in_another_order_is_one_line(lm_data, tmp_path):
    """A checkpoint whose record lists the parameters in another order than the model's (as a
    converter that misplaced Adam's moments writes it) is refused on load, before any update;
    with --reset-optimizer its moments are not read, and it loads."""
    trainer = _trainer(lm_data, tmp_path)
    path = str(tmp_path / "checkpoint_1_1.pt")
    trainer.consolidate_optimizer()
    trainer.save_checkpoint(path, {})
    assert _trainer(lm_data, tmp_path).load_checkpoint(path) is not None  # in the model's order: loads
    state = torch.load(path, weights_only=False)
    params = state["extra_state"][RECORD_KEY]["params"]
    first, second = params[0], params[1]
    params[0], params[1] = second, first
    torch.save(state, path)
    with pytest.raises(TsConfigError) as refused:
        _trainer(lm_data, tmp_path).load_checkpoint(path)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path} holds optimizer state for {len(params)} parameters in "
                                                      f"another order than this model's {len(params)}")
    assert f"position 0: {second} there, {first} here" in message and "--reset-optimizer" in message
    assert _trainer(lm_data, tmp_path).load_checkpoint(path, reset_optimizer=True) is not None
