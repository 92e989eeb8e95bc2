"""Any checkpoint layout the plugin writes as one single-process state, through the one
checkpoint layout (:mod:`torchscale_fairseq.checkpoints`): ``NAME.pt`` (what the user
passes) names one file, its tensor-parallel parts ``NAME-model_part-K.pt``, its pipeline
stages ``NAME-stageP.pt``, its expert shards ``NAME-shardR.pt``, or several
(``NAME-model_part-K-stageP-shardR.pt``); expert shards are consolidated per part and stage,
then the stages merged, then the parts, as ``ts-consolidate-experts`` and
``ts-reshard --size 1 --pipeline-size 1`` do."""

from __future__ import annotations

from typing import Any

from torchscale_fairseq.checkpoints.convert import consolidate_grid, repipeline_grid, reshard_grid
from torchscale_fairseq.checkpoints.layout import find_checkpoint_files, read_record
from torchscale_fairseq.compat.safe_checkpoints import register_safe_globals
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.checkpoint_loading import read_checkpoint_file


def read_checkpoint(path: str) -> dict[str, Any]:
    """One checkpoint file (weights only, the plugin's allow-list); one line when unreadable."""
    register_safe_globals()
    return read_checkpoint_file(path)


def load_single_process_state(path: str) -> dict[str, Any]:
    """The checkpoint ``path`` as one single-process state (``model``, ``cfg``, ...)."""
    files = find_checkpoint_files(path, "the checkpoint path")
    grid = {position: read_checkpoint(p) for position, p in files.paths.items()}
    for position, state in grid.items():
        record = read_record(state)
        if (record.tp_size, record.pipeline.size, record.ep_size) != (files.tp_size, files.pp_size, files.ep_size):
            raise TsConfigError(
                f"{files.paths[position]} is one of {record.tp_size} tensor-parallel part(s) x {record.pipeline.size} "
                f"pipeline stage(s) x {record.ep_size} expert shard(s) but {len(files.paths)} file(s) were found: a "
                "part, stage or shard is missing"
            )
    if files.ep_size > 1:
        grid = consolidate_grid(grid, files.tp_size, files.ep_size, files.paths, files.pp_size)
    if files.pp_size > 1:
        grid = repipeline_grid(grid, files.tp_size, files.pp_size, 1, 1, names=files.paths)
    if files.tp_size > 1:
        grid = reshard_grid(grid, files.tp_size, 1, 1)
    return grid[(0, 0, 0)]
