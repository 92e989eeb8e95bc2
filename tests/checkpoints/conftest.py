"""A real tensor-parallel x expert-parallel checkpoint, trained once per session:
``fairseq-train`` on 4 gloo processes (``--model-parallel-size 2``, 2 data-parallel
ranks holding 1 of 2 experts each), plus the 4-process model's log-probabilities on a
fixed batch (:mod:`tests.workers.tp_ep_worker`)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.cli_utils import LM_TRAIN
from tests.helpers.mp_helpers import USER_DIR, dist_flags, launch, wait_all
from tests.helpers.rendezvous import rendezvous_url

WORLD, TP = 4, 2
TRAIN = ["--arch", "ts_lm_tiny", "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
         "--decoder-attention-heads", "2", *LM_TRAIN, "--max-update", "2", "--dropout", "0", "--moe-expert-count", "2",
         "--moe-freq", "2", "--criterion", "moe_cross_entropy", "--model-parallel-size", str(TP),
         "--ddp-backend", "legacy_ddp", "--disable-validation", "--num-workers", "0"]


@pytest.fixture(scope="session")
def tp_ep_run(lm_data, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp_ep")
    save, reference = root / "ck", root / "reference.pt"
    init_method = rendezvous_url(root)
    procs, logs = [], []
    for rank in range(WORLD):
        log = root / f"rank{rank}.log"
        cmd = [sys.executable, "-m", "tests.workers.tp_ep_worker", str(reference), "fairseq-train", str(lm_data),
               *TRAIN, "--save-dir", str(save), "--user-dir", str(USER_DIR), *dist_flags(WORLD, rank, init_method)]
        procs.append(launch(cmd, log))
        logs.append(log)
    wait_all(procs, logs, timeout=600)
    return {"save": save, "name": save / "checkpoint_last.pt", "data": lm_data,
            "reference": torch.load(reference, weights_only=True)}
