"""Expert-parallel layout over the data-parallel ranks. Under tensor parallelism each
tensor-parallel rank has its own data-parallel group and the all-to-all runs inside it:
the ranks of one tensor-parallel group hold the same experts, each its shard of every
expert (``--moe-expert-tensor-parallel split``) or whole copies (``replicate``). Under context
parallelism the "data-parallel" ranks here are those of the data-context group (data-parallel x
context-parallel, ``C D`` ranks; Megatron-core's expert layout spans both axes): every rank of a
context-parallel group routes its own tokens, so the all-to-all and the replica sums may cross
context-parallel ranks as they cross data-parallel ones.

With ``W`` data-parallel ranks and ``E`` experts, the experts are spread over all-to-all groups
of ``A`` consecutive data-parallel ranks, ``E / A`` experts per rank (position ``r`` of a group
holds experts ``r E/A ... (r+1) E/A - 1``); the ranks at the same position of each group hold
replicas of the same experts (the replica group, over which their gradients are summed).
``A`` is ``--moe-expert-parallel-size`` (Megatron-core's expert parallel size, decoupled from the
data-parallel size: ``A`` must divide ``W`` and ``E``), or by default:
- ``E`` a multiple of ``W``: ``A = W``, no replicas;
- ``W`` a multiple of ``E``: ``A = E``, one expert per rank.

The groups depend on ``A`` alone (:class:`ExpertGroups`, one per size); ``E`` only decides which
experts are local (:meth:`ExpertGroups.place`). They are created once, with the other groups of
the run, by :func:`~torchscale_fairseq.model_parallel.parallel_context.build_parallel_context`;
the model builder looks its groups up in the context by ``A``, and so do the gradient norm, the
expert gradient sync and the checkpoint record, from the size an expert parameter is tagged with
(:func:`~torchscale_fairseq.model_parallel.attributes.mark_expert`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from torchscale_fairseq.errors import TsConfigError


@dataclass(frozen=True)
class ExpertParallel:
    """Where one MoE configuration's experts live on this rank (``group``: the all-to-all group,
    ``None`` when every expert is local)."""

    num_experts: int
    local_experts: int
    first_expert: int
    world: int = 1
    rank: int = 0
    group: object | None = None
    replica_group: object | None = None
    data_parallel_group: object | None = None  # the whole layout's (data-context under context parallelism)


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel groups of all-to-all size ``size`` (``A``): ``rank`` its position
    in its all-to-all ``group`` (``None`` when ``A = 1``), ``replica_group`` the ranks at the same
    position of the other all-to-all groups (``None`` when ``A = W``)."""

    size: int = 1
    rank: int = 0
    group: object | None = None
    replica_group: object | None = None
    data_parallel_group: object | None = None

    def place(self, num_experts: int) -> ExpertParallel:
        """Where ``num_experts`` experts live: ``E / A`` per rank, position ``r`` holding experts
        ``r E/A ... (r+1) E/A - 1`` (``A`` divides ``E``: :func:`expert_layout`)."""
        local = num_experts // self.size
        return ExpertParallel(num_experts, local, self.rank * local, self.size, self.rank, self.group,
                              self.replica_group, self.data_parallel_group)


def expert_layout(world: int, num_experts: int, expert_parallel_size: int = 0) -> tuple[int, int]:
    """``(all-to-all group size, experts per rank)`` over ``world`` data-parallel ranks
    (``expert_parallel_size`` 0: the default above); one-line error when incompatible."""
    size = expert_parallel_size
    if size < 0:
        raise TsConfigError(f"--moe-expert-parallel-size {size} is negative: use 0 (the default layout) or a "
                            "divisor of the data-parallel size")
    if size:
        if world % size:
            raise TsConfigError(f"--moe-expert-parallel-size {size} does not divide the {world} data-parallel "
                                f"rank(s): use a divisor of {world} (or 0 for the default layout)")
        if num_experts % size:
            raise TsConfigError(f"--moe-expert-parallel-size {size} does not divide --moe-expert-count "
                                f"{num_experts}: use a size that divides both {num_experts} and {world}")
        return size, num_experts // size
    if num_experts % world == 0:
        return world, num_experts // world
    if world % num_experts == 0:
        return num_experts, 1
    raise TsConfigError(
        f"--moe-expert-count {num_experts} is not compatible with {world} data-parallel ranks: "
        "use an expert count that is a multiple or a divisor of the data-parallel world size"
    )


def build_expert_groups(data_layout: list[list[int]], rank: int, data_group: object | None,
                        size: int) -> ExpertGroups:
    """This rank's groups of all-to-all size ``size``, creating the all-to-all and replica groups of
    every data-parallel group in ``data_layout`` (a collective: every rank calls it with the same
    arguments, ``data_group`` its own data-parallel group, reused where a group spans it)."""
    world = len(data_layout[0])
    if size < 1 or world % size:
        raise TsConfigError(f"expert-parallel size {size} does not divide the {world} data-parallel rank(s): use a "
                            f"divisor of {world}")
    result = ExpertGroups(size)
    for dp_ranks in data_layout:
        blocks = [dp_ranks[i: i + size] for i in range(0, world, size)]
        replica_sets = [dp_ranks[j::size] for j in range(size)]
        a2a_groups = [dist.new_group(b) if 1 < size < world else None for b in blocks]
        replica_groups = [dist.new_group(r) if 1 < len(r) < world else None for r in replica_sets]
        if rank not in dp_ranks:
            continue
        block, a2a_rank = divmod(dp_ranks.index(rank), size)
        a2a_group = data_group if size == world else a2a_groups[block]
        replica_group = data_group if size == 1 else replica_groups[a2a_rank]
        result = ExpertGroups(size, a2a_rank, a2a_group if size > 1 else None, replica_group, data_group)
    return result
