"""Per-update fills of the fp32 masters' gradients, ``--bf16``, for ``ts_lm_large``'s layer at 2, 6, 12 and 24
layers (width 32 on the CPU: the count does not depend on the width): the ``zero_`` ops fairseq's
``FP16Optimizer.zero_grad`` dispatches, and the ops of the plugin's ``ForeachFP16Optimizer.zero_grad``.

    python zero_fills.py DATA_BIN
"""

import collections
import sys

import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.optim import FP16Optimizer
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.cli_utils import USER_DIR
from tests.workers.dist_harness import sample_of
from torchscale_fairseq.integration.trainer import TsTrainer
from torchscale_fairseq.optim.flat_master import ForeachFP16Optimizer


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def fills(data: str, layers: int) -> tuple[int, int, dict]:
    argv = [data, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_large", "--cpu", "--bf16",
            "--backbone", "magneto", "--decoder-layers", str(layers), "--decoder-embed-dim", "32",
            "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2", "--tokens-per-sample", "16",
            "--optimizer", "ts_adamw", "--lr", "1e-3", "--max-tokens", "4096"]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    trainer = TsTrainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))
    counts = []
    for zero_grad in (FP16Optimizer.zero_grad, ForeachFP16Optimizer.zero_grad):
        trainer.train_step([sample_of(torch.randint(4, 30, (4, 17), generator=torch.Generator().manual_seed(0)))])
        with Ops() as ops:
            zero_grad(trainer.optimizer)
        counts.append(dict(ops.counts))
    return len(trainer.optimizer.fp32_params), counts[0].get("zero_", 0), counts[1]


if __name__ == "__main__":
    print("| layers | fp32 masters | fairseq's zero_grad: zero_ ops | ForeachFP16Optimizer.zero_grad: ops |")
    print("|---|---|---|---|")
    for layers in (2, 6, 12, 24):
        masters, stock, ours = fills(sys.argv[1], layers)
        print(f"| {layers} | {masters} | {stock} | {ours} |", flush=True)
