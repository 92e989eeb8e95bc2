"""Size and rank of a process group, ``None`` meaning a group of one (the convention of every
collective and parallel layer, which take their group as an argument; the groups themselves
come from :mod:`torchscale_fairseq.model_parallel.parallel_context`)."""

from __future__ import annotations

import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank within ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)
