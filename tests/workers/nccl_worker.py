"""The collectives gloo does not document for CUDA tensors (``all_gather``,
``all_to_all_single``), as the plugin calls them, on NCCL at world size 1 (one GPU holds
one NCCL rank). ``python -m tests.workers.nccl_worker INIT_URL`` (a ``file://`` init method,
``tests/helpers/rendezvous.py``); exits non-zero on a mismatch."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from torchscale_fairseq.modules.moe.all_to_all import all_gather_counts, exchange


def main(init_url: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=init_url, rank=0, world_size=1)
    assert dist.get_backend() == "nccl"
    group = dist.group.WORLD
    x = torch.randn(7, 5, device="cuda", requires_grad=True)
    y = exchange(x, [35], [35], group)
    (y * torch.arange(35.0, device="cuda")).sum().backward()
    torch.testing.assert_close(y, x.detach().reshape(-1), rtol=0, atol=0)
    torch.testing.assert_close(x.grad.reshape(-1), torch.arange(35.0, device="cuda"), rtol=0, atol=0)
    counts = torch.tensor([3, 0, 4], device="cuda")
    torch.testing.assert_close(all_gather_counts(counts, group), counts.unsqueeze(0), rtol=0, atol=0)
    total = torch.ones(3, device="cuda")
    dist.all_reduce(total)
    torch.testing.assert_close(total, torch.ones(3, device="cuda"))
    dist.destroy_process_group()
    print("nccl world size 1: all_to_all_single, all_gather, all_reduce on CUDA tensors: ok")


if __name__ == "__main__":
    main(sys.argv[1])
