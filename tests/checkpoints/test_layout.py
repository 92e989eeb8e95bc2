"""The layout module on its own: file names as fairseq-train writes them, the grid of a
checkpoint's files, the record of checkpoints saved before it had expert fields (ranks
from the Megatron-LM order: tensor-parallel groups are consecutive global ranks), and the
one-line load checks."""

from __future__ import annotations

import pytest
import torch

from torchscale_fairseq.checkpoints.layout import (
    check_checkpoint_name,
    check_expert_shards,
    check_tensor_parallel_size,
    checkpoint_suffix,
    find_checkpoint_files,
    read_record,
    split_suffix,
)
from torchscale_fairseq.errors import TsConfigError


@pytest.mark.parametrize("ranks,base,want", [  # (tp_rank, tp_size, ep_rank, ep_size, pp_rank, pp_size)
    ((0, 1, 0, 1, 0, 1), "", ""),
    ((1, 2, 0, 1, 0, 1), "", "-model_part-1"),
    ((0, 1, 3, 4, 0, 1), "", "-shard3"),
    ((1, 2, 1, 2, 0, 1), "", "-model_part-1-shard1"),
    ((0, 2, 0, 2, 0, 1), "-ft", "-ft-model_part-0-shard0"),
    ((0, 1, 0, 1, 3, 4), "", "-stage3"),
    ((1, 2, 1, 2, 1, 2), "-ft", "-ft-model_part-1-stage1-shard1"),
])
def test_suffix_is_todays_file_name(ranks, base, want):
    tp_rank, tp_size, ep_rank, ep_size, pp_rank, pp_size = ranks
    assert checkpoint_suffix(tp_rank, tp_size, ep_rank, ep_size, base, pp_rank, pp_size) == want
    assert split_suffix(want) == (base, tp_rank if tp_size > 1 else None, pp_rank if pp_size > 1 else None,
                                  ep_rank if ep_size > 1 else None)


def _old_state(rank: int, world: int, tp: int, experts: int) -> dict:
    return {"cfg": {"common": {"model_parallel_size": tp}, "model": {"moe_expert_count": experts},
                    "distributed_training": {"distributed_rank": rank, "distributed_world_size": world}},
            "extra_state": {"ts_tensor_parallel": {"size": tp, "layout": {}, "params": [], "rng": {}}}}


@pytest.mark.parametrize("rank,want", [(0, (0, 2, 0)), (1, (1, 2, 0)), (2, (0, 2, 1)), (3, (1, 2, 1))])
def test_old_record_ranks_from_the_global_rank(rank, want):
    record = read_record(_old_state(rank, 4, 2, experts=2))
    assert (record.tp_rank, record.ep_size, record.ep_rank) == want
    dense = read_record(_old_state(rank, 4, 2, experts=0))
    assert (dense.ep_size, dense.ep_rank) == (1, 0)


def _touch(path) -> None:
    torch.save({}, path)


def test_grid_of_files_and_its_errors(tmp_path):
    name = tmp_path / "checkpoint_last.pt"
    for k in range(2):
        for r in range(3):
            _touch(tmp_path / f"checkpoint_last-model_part-{k}-shard{r}.pt")
    _touch(tmp_path / "checkpoint_last_backup.pt")  # another checkpoint's name
    _touch(tmp_path / "checkpoint_best-model_part-0.pt")
    files = find_checkpoint_files(str(name))
    assert (files.tp_size, files.pp_size, files.ep_size) == (2, 1, 3)
    assert files.paths[(1, 0, 2)].endswith("checkpoint_last-model_part-1-shard2.pt")
    (tmp_path / "checkpoint_last-model_part-0-shard1.pt").unlink()
    with pytest.raises(TsConfigError, match=r"checkpoint_last-model_part-0-shard1.pt is missing"):
        find_checkpoint_files(str(name))
    _touch(tmp_path / "checkpoint_last-model_part-0.pt")
    with pytest.raises(TsConfigError, match="files of different layouts"):
        find_checkpoint_files(str(name))
    with pytest.raises(TsConfigError, match="no checkpoint .*checkpoint_x.pt.*check --input"):
        find_checkpoint_files(str(tmp_path / "checkpoint_x.pt"), "--input")


def test_grid_of_pipeline_stages(tmp_path):
    name = tmp_path / "checkpoint_1_4.pt"
    for k in range(2):
        for p in range(3):
            _touch(tmp_path / f"checkpoint_1_4-model_part-{k}-stage{p}.pt")
    files = find_checkpoint_files(str(name))
    assert (files.tp_size, files.pp_size, files.ep_size) == (2, 3, 1)
    assert files.paths[(1, 2, 0)].endswith("checkpoint_1_4-model_part-1-stage2.pt")
    with pytest.raises(TsConfigError, match="names one file of a sharded checkpoint"):
        find_checkpoint_files(str(tmp_path / "checkpoint_1_4-model_part-1-stage2.pt"))
    (tmp_path / "checkpoint_1_4-model_part-1-stage1.pt").unlink()
    with pytest.raises(TsConfigError, match=r"checkpoint_1_4-model_part-1-stage1.pt is missing"):
        find_checkpoint_files(str(name))
    with pytest.raises(TsConfigError, match=r"saved as 3 pipeline stages.*--pipeline-size 1 --size 2"):
        check_checkpoint_name(str(name), 2)
    with pytest.raises(TsConfigError, match="names one checkpoint part or pipeline stage"):
        check_checkpoint_name(str(tmp_path / "checkpoint_1_4-stage0.pt"), 1)


def test_load_checks_name_the_conversion_command(tmp_path):
    part = _old_state(1, 4, 2, experts=2)
    with pytest.raises(TsConfigError, match=r"saved at --model-parallel-size 2 but this run uses 1: .*ts-reshard "
                                            r"--input ck.pt --size 1"):
        check_tensor_parallel_size(part, "ck-model_part-1.pt", 1)
    check_tensor_parallel_size(part, "ck-model_part-1.pt", 2)
    with pytest.raises(TsConfigError, match=r"one of 2 expert shards but this run uses 1: .*ts-consolidate-experts "
                                            r"ck.pt -o NEW.pt"):
        check_expert_shards(part, "ck-model_part-1-shard1.pt", 1)
    with pytest.raises(TsConfigError, match="experts of 2 data-parallel rank"):
        check_expert_shards(part, "ck-model_part-1-shard1.pt", 4)
    check_expert_shards(part, "ck-model_part-1-shard1.pt", 2)
    _touch(tmp_path / "ck-model_part-0.pt")
    _touch(tmp_path / "ck-model_part-1.pt")
    with pytest.raises(TsConfigError, match="saved at --model-parallel-size 2 but this run uses 1"):
        check_checkpoint_name(str(tmp_path / "ck.pt"), 1)
    with pytest.raises(TsConfigError, match="names one checkpoint part"):
        check_checkpoint_name(str(tmp_path / "ck-model_part-0.pt"), 2)
