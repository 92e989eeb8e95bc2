"""Two gloo ranks run MoE layers on different token counts (one rank all padding in the
second step); the run must finish, and once the ranks leave, no reference (the expert-parallel
layout included) keeps the destroyed process group alive until interpreter shutdown.
Usage: ``python -m tests.workers.uneven_worker INIT_METHOD``."""

from __future__ import annotations

import sys
import weakref

import torch
import torch.distributed as dist

from tests.helpers.rendezvous import leave_process_group, start_ranks


def worker(rank: int, init_method: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    from torchscale_fairseq.model_parallel.parallel_context import build_parallel_context
    from torchscale_fairseq.modules.feedforward import FFNSpec
    from torchscale_fairseq.modules.moe.config import MoEConfig
    from torchscale_fairseq.modules.moe.layer import MoELayer

    experts = build_parallel_context(1).expert_parallel(4)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(expert_count=4, top_k=2, capacity_factor=1.0), FFNSpec(8, 16), parallel=experts)
    for length, all_pad in ((5 if rank == 0 else 13, False), (7, rank == 1)):
        x = torch.randn(2, length, 8, requires_grad=True)
        mask = torch.zeros(2, length, dtype=torch.bool)
        mask[:, length - 2:] = True
        if all_pad:
            mask[:] = True
        y, aux = layer(x, mask)
        (y.sum() + aux.balance_loss).backward()
        assert torch.equal(y[mask], torch.zeros_like(y[mask]))
    world = weakref.ref(dist.group.WORLD)
    del layer, experts, x, y, aux, mask
    leave_process_group()
    assert world() is None, "a reference keeps the destroyed process group alive until interpreter shutdown"


if __name__ == "__main__":
    start_ranks(worker, (sys.argv[1],), 2)
