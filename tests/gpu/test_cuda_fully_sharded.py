"""``--zero-sharding full`` on CUDA (``tests/workers/fully_sharded_cuda_worker.py``): the plugin's
FSDP2 sharding with the ``--bf16`` policy (fp32 shards, bf16 compute, fp32 gradient reduction) on
NCCL at world size 1 (one GPU holds one NCCL rank) trains as the unsharded bf16 path with an fp32
master, on the same batches: losses, first gradients and parameters after 4 updates equal within
bf16's precision (on CPU, with gloo, the two are bitwise equal). Two-rank equivalence with DDP is
``tests/optim/test_fully_sharded.py``'s, on CPU."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.cli_utils import REPO, run
from tests.helpers.rendezvous import rendezvous_url

pytestmark = pytest.mark.gpu

BF16 = 2.0 ** -6  # a few units in bf16's last place (8 significant bits)


def _close(full: torch.Tensor, plain: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(full, plain, rtol=BF16, atol=BF16 * float(plain.abs().max()), msg=name)


def test_fully_sharded_bf16_on_nccl_equals_unsharded(tmp_path):
    out = tmp_path / "result.pt"
    run([sys.executable, "-m", "tests.workers.fully_sharded_cuda_worker", rendezvous_url(tmp_path), str(out)],
        cwd=REPO, timeout=300)
    result = torch.load(out)
    assert result["dtypes"] == {"param": "torch.float32", "grad": "torch.float32", "logits": "torch.bfloat16"}
    assert result["placements"] == ["(Shard(dim=0),)"]
    plain, full = result["losses"]["plain"], result["losses"]["full"]
    assert full == pytest.approx(plain, rel=BF16)
    assert plain[-1] < plain[0], "the runs must train"
    for what in ("grads", "params"):
        assert result[what]["full"].keys() == result[what]["plain"].keys()
        for name, value in result[what]["full"].items():
            _close(value, result[what]["plain"][name], f"{what} {name}")
