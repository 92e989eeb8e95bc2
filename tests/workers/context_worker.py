"""One rank of the parallel-context check (run by ``test_parallel_context.py``).

``python context_worker.py RANK WORLD INIT_METHOD OUT``: on 4 gloo ranks every rank builds the
contexts of :data:`CASES` (in the same order), looks expert layouts up in them, and finds each group's members by an all-reduce
of its global rank, one-hot, inside the group; rank 0 writes every rank's findings, with the
context's own ranks, sizes and stage flags, to ``OUT`` (JSON).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tests.helpers.rendezvous import leave_process_group
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.parallel_context import build_parallel_context

# name: (tensor size, pipeline size, expert-parallel sizes (None: every divisor of the data-parallel
# x context-parallel size), the (expert count, --moe-expert-parallel-size) layouts looked up, context size)
CASES = {
    "t2p2": (2, 2, None, [(4, 0)], 1),  # data-parallel size 1: no expert group, every expert local
    "p4": (1, 4, None, [], 1),  # middle stages: in no embedding group
    "experts": (1, 1, None, [(4, 0), (2, 0), (4, 2), (4, 1)], 1),  # sizes 1, 2 and 4
    "experts_a2": (1, 1, [2, 2], [(4, 2), (2, 0)], 1),  # the repeated size is built once
    "experts_c2": (1, 1, None, [(4, 0), (4, 2)], 2),  # experts over data x context ranks
}


def members(group, rank: int, world: int) -> list[int]:
    """The global ranks in ``group`` (``None``: this rank alone)."""
    if group is None:
        return [rank]
    one_hot = torch.zeros(world, dtype=torch.long)
    one_hot[rank] = 1
    dist.all_reduce(one_hot, group=group)
    return [r for r in range(world) if one_hot[r]]


def findings(tensor: int, pipeline: int, sizes: list[int] | None, lookups: list[tuple[int, int]], context: int,
             rank: int, world: int) -> dict:
    ctx = build_parallel_context(tensor, pipeline, sizes, context)
    out = {
        "tensor": members(ctx.tensor_group, rank, world), "tensor_ranks": list(ctx.tensor_ranks),
        "data": members(ctx.data_group, rank, world), "data_ranks": list(ctx.data_ranks),
        "pipeline": members(ctx.pipeline_group, rank, world), "pipeline_ranks": list(ctx.pipeline_ranks),
        "embedding": members(ctx.embedding_group, rank, world) if ctx.embedding_ranks else [],
        "embedding_ranks": list(ctx.embedding_ranks),
        "positions": [ctx.tensor_rank, ctx.data_rank, ctx.pipeline_rank],
        "sizes": [ctx.tensor_size, ctx.data_size, ctx.pipeline_size],
        "stages": [ctx.is_first_stage, ctx.is_last_stage], "world": ctx.world_size, "rank": ctx.rank,
        "expert_groups": sorted(ctx.expert_groups), "experts": {},
    }
    for count, size in lookups:
        layout = ctx.expert_parallel(count, size)
        out["experts"][f"{count}/{size}"] = {
            "all_to_all": members(layout.group, rank, world), "replicas": members(layout.replica_group, rank, world),
            "first": layout.first_expert, "local": layout.local_experts, "size": layout.world,
        }
    try:
        ctx.expert_parallel(4, 0)
        out["unbuilt"] = ""
    except TsConfigError as e:
        out["unbuilt"] = str(e)
    return out


def main() -> None:
    rank, world, init_method, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    mine = {name: findings(*case, rank, world) for name, case in CASES.items()}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f, indent=1)
    leave_process_group()


if __name__ == "__main__":
    main()
