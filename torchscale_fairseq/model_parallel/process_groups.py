"""Tensor-parallel and data-parallel process groups (Megatron-LM appendix B.1).

Tensor-parallel groups are blocks of consecutive ranks; data-parallel groups join the
ranks at the same position in every tensor-parallel group. With W ranks and tensor
parallel size N: TP groups ``[k*N, ..., k*N + N - 1]``, DP groups ``[i, i + N, ...]``.
Without initialisation (single process) everything degenerates to size 1, rank 0.

The accessors below are read at the edge (model building, the trainer, the criterions);
collectives and parallel layers take their group as an argument, ``None`` meaning a
group of one (:func:`group_size`, :func:`group_rank`).
"""

from __future__ import annotations

import torch.distributed as dist

from torchscale_fairseq.errors import TsConfigError

_TP_GROUP: dist.ProcessGroup | None = None
_DP_GROUP: dist.ProcessGroup | None = None
_TP_RANKS: list[int] = [0]
_DP_RANKS: list[int] = [0]
_TP_SIZE: int = 1


def tensor_parallel_groups_layout(world_size: int, tp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The rank lists of every tensor-parallel and every data-parallel group."""
    if tp_size < 1 or world_size % tp_size != 0:
        raise TsConfigError(
            f"--model-parallel-size {tp_size} does not divide the world size {world_size}: "
            "use a model-parallel size that divides --distributed-world-size"
        )
    tp = [list(range(k * tp_size, (k + 1) * tp_size)) for k in range(world_size // tp_size)]
    dp = [list(range(i, world_size, tp_size)) for i in range(tp_size)]
    return tp, dp


def initialize_model_parallel(tp_size: int) -> None:
    """Create the groups; every rank must call this with the same ``tp_size``."""
    global _TP_GROUP, _DP_GROUP, _TP_RANKS, _DP_RANKS, _TP_SIZE
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    tp_layout, dp_layout = tensor_parallel_groups_layout(world_size, tp_size)
    for ranks in tp_layout:
        group = dist.new_group(ranks)
        if rank in ranks:
            _TP_GROUP, _TP_RANKS = group, ranks
    for ranks in dp_layout:
        group = dist.new_group(ranks)
        if rank in ranks:
            _DP_GROUP, _DP_RANKS = group, ranks
    _TP_SIZE = tp_size


def destroy_model_parallel() -> None:
    """Forget the tensor- and data-parallel groups (Megatron-LM's ``destroy_model_parallel``), so
    that no module global keeps a process group alive past ``dist.destroy_process_group``."""
    global _TP_GROUP, _DP_GROUP, _TP_RANKS, _DP_RANKS, _TP_SIZE
    _TP_GROUP, _DP_GROUP, _TP_RANKS, _DP_RANKS, _TP_SIZE = None, None, [0], [0], 1


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank within ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def model_parallel_is_initialized() -> bool:
    return _TP_GROUP is not None


def get_tensor_parallel_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def get_data_parallel_group() -> dist.ProcessGroup | None:
    return _DP_GROUP


def get_tensor_parallel_world_size() -> int:
    return _TP_SIZE


def get_tensor_parallel_rank() -> int:
    if _TP_GROUP is None:
        return 0
    return _TP_RANKS.index(dist.get_rank())


def get_tensor_parallel_ranks() -> list[int]:
    return list(_TP_RANKS)


def get_data_parallel_ranks() -> list[int]:
    return list(_DP_RANKS)


def get_data_parallel_world_size() -> int:
    if _DP_GROUP is None:
        return dist.get_world_size() if dist.is_initialized() else 1
    return len(_DP_RANKS)


def get_data_parallel_rank() -> int:
    if _DP_GROUP is None:
        return dist.get_rank() if dist.is_initialized() else 0
    return _DP_RANKS.index(dist.get_rank())
