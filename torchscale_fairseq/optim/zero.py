"""``--zero-sharding os``: ZeRO stage 1, optimizer-state partitioning (Rajbhandari et al.
2020, "ZeRO", section 5.1, ``P_os``), for any torch optimizer fairseq builds.

Every data-parallel rank still holds all parameters and, after DDP's all-reduce, all
gradients (so a gradient norm, SparseClip's included, is taken as without sharding). The
replicated parameters are split among the ``N`` ranks of the data-parallel group, each
parameter whole, greedily by size (largest first, to the least loaded rank), so a rank
holds optimizer state for ``total / N`` elements up to one parameter. A step:

    1. every rank steps the base optimizer on the parameters it owns (the others' gradients
       are hidden for the step, so the base creates no state for them);
    2. each rank broadcasts the parameters it owns to the group (one flat bucket per rank
       and dtype).

Parameters for which ``is_local(p)`` holds (experts spread over data-parallel ranks: every
rank has different ones, nothing to share) are stepped by their own rank and never
broadcast: each rank keeps their state, unsharded.

The state dict has the format of the base optimizer's over all parameters, so checkpoints
written with and without sharding are interchangeable: :meth:`consolidate_state_dict`
gathers the owners' states (to the group's rank 0, or to every rank when each saves its own
file), :meth:`load_state_dict` takes a full state dict and keeps the owned part.

Why not ``torch.distributed.optim.ZeroRedundancyOptimizer``: it broadcasts every parameter
from one owner (experts must stay local) and consolidates to a single rank (expert-sharded
runs save one file per rank, each with the whole dense state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from torchscale_fairseq.errors import TsConfigError

LOCAL = -1  # owner of a parameter every rank steps itself


def assign_owners(numels: list[int], world: int, local: list[bool]) -> list[int]:
    """Owner rank of each parameter: largest first to the least loaded rank (ties to the
    lower index and rank), ``LOCAL`` for local parameters; every rank computes the same."""
    owners = [LOCAL] * len(numels)
    load = [0] * world
    for i in sorted((i for i in range(len(numels)) if not local[i]), key=lambda i: (-numels[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


def check_zero_sharding(cfg: Any, data_parallel_size: int) -> None:
    """One line, before any work, for a ``--zero-sharding os`` run it cannot shard."""
    if cfg.distributed_training.zero_sharding != "os":
        return
    common = cfg.common
    if data_parallel_size < 2:
        raise TsConfigError("--zero-sharding os shards the optimizer state over data-parallel ranks and this run "
                            "has one: drop --zero-sharding or train on more ranks")
    if cfg.distributed_training.ddp_backend == "fully_sharded":
        raise TsConfigError("--ddp-backend fully_sharded shards the optimizer state itself: drop --zero-sharding")
    if cfg.optimization.use_bmuf:
        raise TsConfigError("--zero-sharding os does not combine with --use-bmuf: drop one of them")
    flat = ((common.fp16 or common.bf16) and not (common.memory_efficient_fp16 or common.memory_efficient_bf16)
            and not common.amp and not common.fp16_no_flatten_grads)
    if flat:
        raise TsConfigError("--zero-sharding os shards per parameter and --fp16/--bf16 keep one flat fp32 master: "
                            "add --fp16-no-flatten-grads")


def _to_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


class ShardedOptimizerState(torch.optim.Optimizer):
    """A torch optimizer whose state is partitioned over ``group`` (module docstring). Its
    ``param_groups`` and ``state`` are the base optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup,
                 is_local: Callable[[torch.Tensor], bool] = lambda p: False,
                 consolidate_to_all: bool = False) -> None:
        # no Optimizer.__init__: param_groups, state and defaults are the base's
        self.optim = optimizer
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.consolidate_to_all = consolidate_to_all
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        local = [bool(is_local(p)) for p in self._params]
        self.owners = assign_owners([p.numel() for p in self._params], self.world, local)
        self._buckets: list[list[list[torch.Tensor]]] = []  # per rank: lists of same-dtype params
        for rank in range(self.world):
            by_kind: dict[tuple, list[torch.Tensor]] = {}
            for p, owner in zip(self._params, self.owners):
                if owner == rank:
                    by_kind.setdefault((p.dtype, p.device), []).append(p)
            self._buckets.append(list(by_kind.values()))
        self._consolidated: dict | None = None

    # the base optimizer's attributes --------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    @property
    def state(self) -> dict:
        return self.optim.state

    @property
    def defaults(self) -> dict:
        return self.optim.defaults

    def __getattr__(self, name: str) -> Any:
        # fairseq's capability flags (supports_step_with_scale, ...) are the base's
        if name.startswith("supports") and "optim" in self.__dict__:
            return getattr(self.__dict__["optim"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def disable_mem_eff_fp16_loading_hack(self) -> bool:
        """fairseq's ``--memory-efficient-fp16`` loader would restore every parameter's state;
        :meth:`load_state_dict` keeps the saved dtypes itself."""
        return True

    def owns(self, index: int) -> bool:
        """This rank steps parameter ``index`` (it owns it, or the parameter is local)."""
        return self.owners[index] in (LOCAL, self.rank)

    def local_state_numel(self) -> int:
        """Elements of the tensors in this rank's optimizer state (Adam: ``exp_avg`` and
        ``exp_avg_sq``), scalars (step counts) excluded."""
        return sum(v.numel() for s in self.optim.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0)

    # step ------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable | None = None, **kwargs: Any) -> Any:
        """Step the owned and local parameters, then broadcast each rank's owned ones."""
        hidden = {}
        for i, p in enumerate(self._params):
            if not self.owns(i) and p.grad is not None:
                hidden[i], p.grad = p.grad, None
        try:
            loss = self.optim.step(closure, **kwargs)
        finally:
            for i, grad in hidden.items():
                self._params[i].grad = grad
        self._broadcast_owned()
        self._consolidated = None
        return loss

    def _broadcast_owned(self) -> None:
        for rank, buckets in enumerate(self._buckets):
            src = dist.get_global_rank(self.group, rank)
            for params in buckets:
                flat = _flatten_dense_tensors([p.data for p in params])
                dist.broadcast(flat, src=src, group=self.group)
                if rank != self.rank:
                    for p, value in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
                        p.data.copy_(value)

    # state dict ----------------------------------------------------------------------

    def consolidate_state_dict(self) -> None:
        """Gather the owners' states (a collective of the whole group): the full state dict
        is then on the group's rank 0, or on every rank with ``consolidate_to_all``."""
        own = self.optim.state_dict()
        shared = {i: _to_cpu(s) for i, s in own["state"].items() if self.owners[i] == self.rank}
        if self.consolidate_to_all:
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, shared, group=self.group)
        else:
            parts = [None] * self.world if self.rank == 0 else None
            dist.gather_object(shared, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if parts is None:
            self._consolidated = None
            return
        state = {i: s for i, s in own["state"].items() if self.owners[i] == LOCAL}
        for part in parts:
            state.update(part)
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": own["param_groups"]}

    def state_dict(self) -> dict:
        """The full state dict gathered by the last :meth:`consolidate_state_dict` (since
        the last step), in the base optimizer's format."""
        if self._consolidated is None:
            raise RuntimeError("the sharded optimizer state is not consolidated on this rank: call "
                               "consolidate_state_dict() on every rank of the group first")
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict (of this optimizer or of the unsharded base), keeping the
        owned and local parameters' state, with their saved dtypes."""
        owned = {i: s for i, s in state_dict["state"].items() if self.owns(int(i))}
        self.optim.load_state_dict({"state": owned, "param_groups": state_dict["param_groups"]})
        for i, saved in owned.items():
            p = self._params[int(i)]
            loaded = self.optim.state[p]
            for key, value in saved.items():
                if torch.is_tensor(value) and key != "step" and value.dtype != loaded[key].dtype:
                    loaded[key] = value.to(device=p.device)
        self._consolidated = None

    def broadcast_global_state_dict(self, state_dict: Any) -> Any:
        """The full state dict read by the group's rank 0, sent to every rank."""
        box = [state_dict]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]


def shard_optimizer_state(optimizer: Any, group: dist.ProcessGroup, is_local: Callable[[torch.Tensor], bool],
                          consolidate_to_all: bool) -> ShardedOptimizerState:
    """Replace the torch optimizer inside the fairseq optimizer ``optimizer`` (through its
    precision wrappers) by a :class:`ShardedOptimizerState` over ``group``."""
    sharded = ShardedOptimizerState(optimizer.optimizer, group, is_local, consolidate_to_all)
    optimizer.optimizer = sharded
    return sharded
