"""``python stall_cli.py UPDATE ARGS...``: ``fairseq-train ARGS`` that stops making progress
once ``UPDATE`` updates are done and logged (it sleeps before the next update), so a test
can SIGKILL it at a known point instead of racing a fast run."""

import sys
import time

from fairseq_cli.train import cli_main

import torchscale_fairseq  # noqa: F401  (installs the plugin before fairseq runs)
from torchscale_fairseq.integration.trainer import TsTrainer

STALL_AFTER = int(sys.argv.pop(1))
_train_step = TsTrainer.train_step


def train_step(self, samples, raise_oom=False):
    while self.get_num_updates() >= STALL_AFTER:
        time.sleep(1)
    return _train_step(self, samples, raise_oom)


TsTrainer.train_step = train_step

if __name__ == "__main__":
    sys.argv[0] = "fairseq-train"
    cli_main()
