"""``python zero_cli.py STALL ARGS...``: ``fairseq-train ARGS`` for the ``--zero-sharding``
tests. After every update it prints the elements this rank holds of its optimizer state (tensors
of rank >= 1: Adam's ``exp_avg`` and ``exp_avg_sq``; a DTensor's local shard), split into dense and expert
parameters, as ``optimizer-state {...}``; logged meters are not rounded (as
``tests/workers/unrounded_cli.py``), so losses compare to the last bit; with
``STALL > 0`` it stops making progress after update ``STALL`` (as
``tests/workers/stall_cli.py``), for a test to SIGKILL it there."""

import json
import sys
import time

import torch
from fairseq_cli.train import cli_main
from torch.distributed.tensor import DTensor
from unrounded_cli import unround_meters

import torchscale_fairseq  # noqa: F401  (installs the plugin before fairseq runs)
from torchscale_fairseq.integration.trainer import TsTrainer
from torchscale_fairseq.model_parallel.attributes import is_expert

STALL_AFTER = int(sys.argv.pop(1))
_train_step = TsTrainer.train_step


def train_step(self, samples, raise_oom=False):
    while 0 < STALL_AFTER <= self.get_num_updates():
        time.sleep(1)
    out = _train_step(self, samples, raise_oom)
    numel = {"dense": 0, "expert": 0}
    for param, state in self.optimizer.optimizer.state.items():
        kind = "expert" if is_expert(param) else "dense"
        numel[kind] += sum((v.to_local() if isinstance(v, DTensor) else v).numel() for v in state.values()
                           if torch.is_tensor(v) and v.dim() > 0)
    print("optimizer-state " + json.dumps({"rank": self.data_parallel_rank, "updates": self.get_num_updates(),
                                           "largest": max(p.numel() for p in self.model.parameters()), **numel}),
          flush=True)
    return out


TsTrainer.train_step = train_step
unround_meters()

if __name__ == "__main__":
    sys.argv[0] = "fairseq-train"
    cli_main()
