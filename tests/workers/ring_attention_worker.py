"""One rank of the ring-attention checks (run by ``tests/model_parallel/test_context_parallel.py``).

``python ring_attention_worker.py RANK WORLD INIT_METHOD OUT``: for each context-parallel size
``C`` of :data:`SIZES` (groups of the first ``C`` ranks), every rank builds the same full
``(B, h, T, d)`` queries, keys, values and output gradient, runs
:func:`~torchscale_fairseq.model_parallel.context_parallel.ring_attention` on its chunks ``r`` and
``2C-1-r`` and compares the output and the three input gradients with those of the plain causal
attention on the whole sequence (``gathered_causal_attention``), in float64 and float32, and in
float64 with document masks (documents as short as one token, so that whole query rows of a ring
block have no key left); rank 0 writes the largest errors and the elements each rank sent forward and backward as JSON to ``OUT``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from benchmarks.collective_recorder import record_collectives
from tests.helpers.rendezvous import leave_process_group
from torchscale_fairseq.model_parallel.context_parallel import (
    context_parallel_indices,
    gathered_causal_attention,
    ring_attention,
)

B, HEADS, CHUNK, HEAD_DIM = 2, 3, 3, 8
SIZES = (2, 3, 4)


def document_ids(length: int, g: torch.Generator) -> torch.Tensor:
    """``(B, length)`` non-decreasing document numbers, a new document at each position with probability 0.4."""
    starts = torch.rand(B, length, generator=g) < 0.4
    starts[:, 0] = False
    return starts.long().cumsum(1)


def check(size: int, rank: int, group, dtype: torch.dtype, documents: bool = False) -> dict:
    length = 2 * size * CHUNK
    g = torch.Generator().manual_seed(100 + size)
    q, k, v, dout = (torch.randn(B, HEADS, length, HEAD_DIM, generator=g, dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ids = document_ids(length, g) if documents else None
    reference = gathered_causal_attention(q, k, v, ids)
    reference.backward(dout)
    idx = context_parallel_indices(length, size, rank)
    local = [t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    with record_collectives(point_to_point=True) as log:
        out = ring_attention(*local, group, list(range(size)), ids)
        out.backward(dout[:, :, idx])
    errors = {"out": (out - reference.detach()[:, :, idx]).abs().max().item()}
    for name, mine, full in zip("qkv", local, (q, k, v)):
        errors[f"d{name}"] = (mine.grad - full.grad[:, :, idx]).abs().max().item()
    sent = {d: sum(n for kind, direction, n in log if kind == "send" and direction == d)
            for d in ("forward", "backward")}
    return {"errors": errors, "sent": sent, "shape": [B, HEADS, length, HEAD_DIM]}


def main() -> None:
    rank, world, init_method, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    groups = {size: dist.new_group(list(range(size))) for size in SIZES}
    mine = {}
    for size in SIZES:
        if rank < size:
            mine[size] = {str(dtype).split(".")[-1]: check(size, rank, groups[size], dtype)
                          for dtype in (torch.float64, torch.float32)}
            mine[size]["float64_documents"] = check(size, rank, groups[size], torch.float64, documents=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        results = {str(size): [ranks[size] for ranks in everyone if size in ranks] for size in SIZES}
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    leave_process_group()


if __name__ == "__main__":
    main()
