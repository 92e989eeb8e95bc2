"""A destroyed default process group kept alive by ``torch.distributed.nn.functional``.

That module declares its differentiable collectives with ``group=group.WORLD`` as a default
argument, evaluated once, when it is imported. Imported after ``init_process_group`` (as it is by
``import torch.distributed.fsdp``, through ``torch.distributed._shard``, which the plugin imports for
``--zero-sharding full``), the functions' ``__defaults__`` hold the WORLD ``ProcessGroup`` itself:
``destroy_process_group`` then leaves it alive until interpreter finalisation, where destroying a
gloo group can abort the process. Imported before, the defaults are ``None``. Applies to every torch
we support (2.x; ``torch/distributed/nn/functional.py`` unchanged through 2.13).

We replace each default that is a ``ProcessGroup`` by ``None``, which every collective resolves to
the default group at call time: what an import before ``init_process_group`` gives, without the
reference.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn_functional


def patch_distributed_nn_defaults() -> None:
    for function in vars(dist_nn_functional).values():
        if callable(function) and getattr(function, "__defaults__", None):
            function.__defaults__ = tuple(None if isinstance(value, dist.ProcessGroup) else value
                                          for value in function.__defaults__)
