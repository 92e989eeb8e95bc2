"""Two gloo data-parallel ranks of ``streaming_lm`` (run by ``test_stream_lm.py``).

``python -m tests.workers.dp_resume_worker DATA OUT INIT_METHOD``: each rank reads ``FULL`` batches
uninterrupted, then ``STOP`` batches, after which only rank 0 takes the iterator state (as
fairseq's ``save_checkpoint``) and writes it; both ranks resume from that file for the rest.
Each rank saves to ``OUT.RANK`` its targets of both runs and how many ``all_gather_object``
calls the uninterrupted run made.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.distributed as dist

from tests.helpers.rendezvous import leave_process_group, start_ranks

WORLD, EPOCH_LEN, FULL, STOP = 2, 3, 8, 5


def read(task, n: int, state: dict | None = None):
    """A new iterator (of a freshly loaded split) after ``n`` training batches, continuing from
    ``state``, and their targets."""
    task.options.batches_per_epoch = EPOCH_LEN
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_sentences=4, num_workers=0)
    if state is not None:
        itr.load_state_dict(state)
    targets = []
    while len(targets) < n:
        targets += [s["target"] for s in itertools.islice(itr.next_epoch_itr(), n - len(targets))]
    return itr, targets


def worker(rank: int, data: str, out: str, init_method: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    from tests.tasks.conftest import build_task
    from torchscale_fairseq.model_parallel.parallel_context import build_parallel_context, set_parallel_context

    set_parallel_context(build_parallel_context(1))
    gathers = []
    all_gather_object = dist.all_gather_object

    def counting_all_gather_object(*args, **kwargs):
        gathers.append(1)
        return all_gather_object(*args, **kwargs)

    dist.all_gather_object = counting_all_gather_object
    task = build_task(data)
    itr, full = read(task, FULL)
    itr.close()
    n_gathers = len(gathers)

    itr, head = read(task, STOP)
    if rank == 0:
        torch.save(itr.state_dict(), f"{out}.state")
    itr.close()
    dist.barrier()
    itr, tail = read(task, FULL - STOP, torch.load(f"{out}.state", weights_only=True))
    itr.close()
    torch.save({"full": full, "resumed": head + tail, "gathers": n_gathers}, f"{out}.{rank}")
    leave_process_group()


if __name__ == "__main__":
    start_ranks(worker, (sys.argv[1], sys.argv[2], sys.argv[3]), WORLD)
