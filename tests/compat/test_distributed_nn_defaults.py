"""``torch.distributed.nn.functional``'s default groups (``compat/distributed_nn_defaults.py``):
the plugin imported after ``init_process_group`` (it imports ``torch.distributed.fsdp``, which
imports that module) leaves no reference to the WORLD group once it is destroyed (stock torch:
the functions' defaults hold it), and a differentiable collective called without a group still
runs on the default group, gradient included."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.cli_utils import cli_env

DESTROYED_WORLD = r"""
import gc, json, sys, weakref
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
imported_before = "torch.distributed.nn.functional" in sys.modules
import torchscale_fairseq  # noqa: F401  (imports torch.distributed.fsdp, installs the fix)
import torch.distributed.nn.functional as F

x = torch.arange(3.0, requires_grad=True)
y = F.all_reduce(x * 2)
y.sum().backward()
world = weakref.ref(dist.group.WORLD)
dist.destroy_process_group()
gc.collect()
print(json.dumps({"imported_before": imported_before, "y": y.tolist(), "grad": x.grad.tolist(),
                  "alive": world() is not None}))
"""


def test_destroyed_world_group_is_collectable(tmp_path):
    proc = subprocess.run([sys.executable, "-c", DESTROYED_WORLD, f"file://{tmp_path / 'rendezvous'}"],
                          capture_output=True, text=True, env=cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"imported_before": False, "y": [0.0, 2.0, 4.0], "grad": [2.0, 2.0, 2.0], "alive": False}
