"""``--zero-sharding full``'s sharding (:func:`~torchscale_fairseq.optim.fully_sharded.shard_model`,
FSDP2 with the ``--bf16`` policy) on NCCL at world size 1 with CUDA tensors, against the
unsharded ``--bf16`` path (fairseq's: a bf16 copy of the model computes, its fp32 gradients step
an fp32 master), on the same batches, with SGD and momentum (a sharded optimizer state; not Adam,
whose ``g / sqrt(v)`` turns rounding noise in the mathematically zero key-bias gradients into
lr-sized steps). ``python -m
tests.workers.fully_sharded_cuda_worker INIT_URL OUT``: writes per-update losses, the first
update's gradients and the final parameters of both runs to ``OUT`` (``torch.save``)."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.helpers.model_utils import build, dictionary
from torchscale_fairseq.optim.fully_sharded import data_parallel_mesh, mixed_precision, shard_model

UPDATES = 4
LR = 0.5


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """The next-token loss (fp32) and the dtype the model computed its logits in."""
    logits = model(tokens[:, :-1])[0]
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)), logits.dtype


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def main(init_url: str, out: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=init_url, rank=0, world_size=1)
    device = torch.device("cuda", 0)
    d = dictionary(64)
    torch.manual_seed(0)
    master = build("lm", d).to(device)  # the unsharded run: fp32 master, bf16 compute copy
    computing = copy.deepcopy(master).to(torch.bfloat16)
    sharded = shard_model(copy.deepcopy(master), data_parallel_mesh(dist.group.WORLD, device), mixed_precision(True))
    batches = [torch.randint(d.nspecial, len(d), (4, 33), device=device) for _ in range(UPDATES)]
    optimizers = {"plain": torch.optim.SGD(master.parameters(), lr=LR, momentum=0.9),
                  "full": torch.optim.SGD(sharded.parameters(), lr=LR, momentum=0.9)}
    result = {"losses": {"plain": [], "full": []}, "dtypes": {}}
    for update, tokens in enumerate(batches):
        with torch.no_grad():
            for low, high in zip(computing.parameters(), master.parameters()):
                low.copy_(high)
        loss, _ = _loss(computing, tokens)
        loss.backward()
        for low, high in zip(computing.parameters(), master.parameters()):
            high.grad = low.grad.float()
            low.grad = None
        result["losses"]["plain"].append(loss.item())
        loss, computed_in = _loss(sharded, tokens)
        loss.backward()
        result["losses"]["full"].append(loss.item())
        if update == 0:
            result["grads"] = {run: {name: _full(p.grad) for name, p in model.named_parameters()}
                               for run, model in (("plain", master), ("full", sharded))}
            result["dtypes"] = {"param": str(next(sharded.parameters()).dtype),
                                "grad": str(next(sharded.parameters()).grad.dtype),
                                "logits": str(computed_in)}
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    result["params"] = {run: {name: _full(p) for name, p in model.named_parameters()}
                        for run, model in (("plain", master), ("full", sharded))}
    result["placements"] = sorted({str(p.placements) for p in sharded.parameters()})
    torch.save(result, out)
    del sharded, optimizers
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
