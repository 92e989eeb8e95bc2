"""``python zero_cli.py ARGS...``: ``fairseq-train ARGS`` that prints, after every update,
the elements of this rank's optimizer state (tensors of rank >= 1: Adam's ``exp_avg`` and
``exp_avg_sq``), split into dense and expert parameters, as ``optimizer-state {...}``."""

import json
import sys

import torch
from fairseq_cli.train import cli_main

import torchscale_fairseq  # noqa: F401  (installs the plugin before fairseq runs)
from torchscale_fairseq.integration.trainer import TsTrainer
from torchscale_fairseq.model_parallel.attributes import is_expert

_train_step = TsTrainer.train_step


def train_step(self, samples, raise_oom=False):
    out = _train_step(self, samples, raise_oom)
    numel = {"dense": 0, "expert": 0}
    for param, state in self.optimizer.optimizer.state.items():
        kind = "expert" if is_expert(param) else "dense"
        numel[kind] += sum(v.numel() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    print("optimizer-state " + json.dumps({"rank": self.data_parallel_rank, "updates": self.get_num_updates(),
                                           "largest": max(p.numel() for p in self.model.parameters()), **numel}),
          flush=True)
    return out


TsTrainer.train_step = train_step

if __name__ == "__main__":
    sys.argv[0] = "fairseq-train"
    cli_main()
