"""``--zero-sharding full``: parameters, gradients and optimizer state sharded over the
data-parallel group (ZeRO stage 3, Rajbhandari et al. 2020, section 5.3, ``P_os+g+p``) with
PyTorch's FSDP2 ``fully_shard``: each transformer layer is one unit, the root (embeddings,
output layer, final norm) another. Every parameter becomes a DTensor sharded on dimension 0
over a 1-D mesh of the data-parallel group; a unit's parameters are all-gathered for its
forward and backward and its gradients reduce-scattered (averaged, as DDP's all-reduce), so
per update the optimizer sees each rank's shard of the gradient DDP would give, and steps it
on its shard of the parameters and moments (memory per rank ``16 Psi / N`` for Adam in mixed
precision, against DDP's ``16 Psi``; section 3 of the paper).

``--bf16``: the sharded parameters and moments stay fp32 and ``MixedPrecisionPolicy`` casts the
gathered parameters to bf16 for compute and reduces gradients in fp32 (no flat fp32 master).

Checkpoints hold full tensors in the unsharded format (:func:`full_model_state`,
:func:`full_optimizer_state`: ``DTensor.full_tensor``, what
``torch.distributed.checkpoint.state_dict``'s ``full_state_dict=True`` does), so a checkpoint of
``full``, ``os`` or no sharding resumes under any of them at any data-parallel size; loading
takes each rank's shard of a full tensor without communication (:func:`accept_full_state`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import copy_parallel_attributes
from torchscale_fairseq.model_parallel.grads import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

# torch.distributed.fsdp and torch.distributed.tensor are imported by the functions that build
# sharded state: importing them is most of the plugin's start-up, which runs without them.

FULL = "full"
LAYER_STACK = "layers"  # the attribute holding a model's transformer layers (ModuleList or ModuleDict)


def check_fully_sharded(cfg: Any, data_size: int, pipeline_size: int, has_experts: bool) -> None:
    """One line, before any work, for a ``--zero-sharding full`` run it cannot serve. ``data_size``:
    the ranks it shards over (data x context-parallel)."""
    if cfg.distributed_training.zero_sharding != FULL:
        return
    common = cfg.common
    if data_size < 2:
        raise TsConfigError("--zero-sharding full shards over data-parallel ranks and this run has one: drop "
                            "--zero-sharding or train on more ranks")
    if cfg.distributed_training.ddp_backend not in ("pytorch_ddp", "c10d"):
        raise TsConfigError(f"--zero-sharding full replaces the DDP wrapper and --ddp-backend "
                            f"{cfg.distributed_training.ddp_backend} brings its own: drop --ddp-backend")
    if cfg.optimization.use_bmuf:
        raise TsConfigError("--zero-sharding full does not combine with --use-bmuf: drop one of them")
    if common.fp16 or common.memory_efficient_fp16 or common.amp:
        raise TsConfigError("--zero-sharding full keeps fp32 shards and computes in bf16 (fp16 would need fairseq's "
                            "flat master and loss scaler): use --bf16, or --zero-sharding os")
    if common.memory_efficient_bf16:
        raise TsConfigError("--zero-sharding full with --memory-efficient-bf16: use --bf16 (the shards stay fp32 and "
                            "the layers compute in bf16)")
    if pipeline_size > 1:
        raise TsConfigError("--zero-sharding full with --pipeline-model-parallel-size > 1: the schedule runs a stage's "
                            "micro-batches in its own order, which fully_shard's per-layer gather and reduce-scatter "
                            "do not follow here; use --zero-sharding os")
    if has_experts:
        raise TsConfigError("--zero-sharding full with experts: each data-parallel rank holds its own experts, which "
                            "cannot be sharded over those ranks; use --zero-sharding os")
    if cfg.ema.store_ema:
        raise TsConfigError("--zero-sharding full with --store-ema: the EMA copy would be a full replica; drop "
                            "--store-ema or use --zero-sharding os")


def data_parallel_mesh(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The 1-D mesh of the data-parallel ``group`` (under tensor parallelism: the ranks of the
    other tensor-parallel groups holding this rank's part; under context parallelism: the data x
    context ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))


def mixed_precision(bf16: bool) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction under ``--bf16``; fp32 otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every transformer layer: the children of each module's ``layers`` stack."""
    found = []
    for module in model.modules():
        stack = getattr(module, LAYER_STACK, None)
        if isinstance(stack, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            found.extend(stack.children() if isinstance(stack, torch.nn.ModuleList) else stack.values())
    return found


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> torch.nn.Module:
    """``fully_shard`` every transformer layer, then the root, over ``mesh`` (in place; returns
    ``model``). The new sharded parameters carry the parallel attributes of the ones they
    replace (tensor-parallel split, sequence-parallel tag), and the model loads full state dicts."""
    from torch.distributed.fsdp import fully_shard

    before = dict(model.named_parameters())
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for name, param in model.named_parameters():
        copy_parallel_attributes(param, before[name])
    model.register_load_state_dict_pre_hook(accept_full_state)
    return model


def accept_full_state(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """A load_state_dict pre-hook: full tensors for sharded parameters become this rank's shard
    (``distribute_tensor`` with ``src_data_rank=None``: every rank holds the full tensor, no
    communication)."""
    from torch.distributed.tensor import distribute_tensor

    for name, param in module.named_parameters(prefix=prefix, remove_duplicate=False):
        value = state_dict.get(name)
        if is_dtensor(param) and value is not None and not is_dtensor(value):
            state_dict[name] = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh,
                                                 param.placements, src_data_rank=None)


def _full(value: Any) -> Any:
    return value.full_tensor() if is_dtensor(value) else value


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every shard gathered (a collective of the data-parallel group;
    a tied tensor gathered once)."""
    gathered: dict[int, torch.Tensor] = {}
    state = {}
    for key, value in model.state_dict().items():
        if is_dtensor(value):
            if id(value) not in gathered:
                gathered[id(value)] = value.full_tensor()
            value = gathered[id(value)]
        state[key] = value
    return state


def full_optimizer_state(state_dict: dict) -> dict:
    """A torch optimizer's state dict with its sharded moments gathered (a collective)."""
    state = {i: {key: _full(value) for key, value in fields.items()} for i, fields in state_dict["state"].items()}
    return {**state_dict, "state": state}


def shard_loaded_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict`` of a full state dict: each moment becomes this rank's
    shard of it, placed as its parameter (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    for param, fields in optimizer.state.items():
        if not is_dtensor(param):
            continue
        for key, value in fields.items():
            if torch.is_tensor(value) and not is_dtensor(value) and value.shape == param.shape:
                fields[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                                src_data_rank=None)
