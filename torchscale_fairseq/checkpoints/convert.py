"""The two conversions of a sharded checkpoint (:mod:`.layout`), on loaded states:

- :func:`reshard_states`: the ``T`` tensor-parallel parts of one expert rank to ``M``
  parts. Sharded tensors follow the recorded layout (split dimension, Q/K/V stride,
  padded vocabulary; :func:`~torchscale_fairseq.model_parallel.partition.reshard`), the
  rest is copied from part 0; per-parameter optimizer moments are resharded like their
  parameters, an optimizer state that is not per-parameter (fp16's flat master) is dropped.
- :func:`consolidate`: the ``S`` expert shards of one tensor-parallel rank to one state.
  Rank ``r`` of an all-to-all group of ``A = min(S, E)`` ranks holds experts
  ``r E/A ... (r+1) E/A - 1`` stacked along dimension 0, so the expert tensors of ranks
  ``0 .. A-1`` are concatenated; ranks ``A ..`` hold replicas and must equal them; dense
  tensors must be identical on every rank. The (sharded) optimizer state is dropped.

A checkpoint with both kinds of shards is converted by applying either per rank of the
other kind (:func:`reshard_grid`, :func:`consolidate_grid`); both in turn give one file.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from torchscale_fairseq.checkpoints.layout import CheckpointLayout, read_record, write_record
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.partition import reshard

# grids of loaded states: states[(tp_rank, ep_rank)]
Grid = dict[tuple[int, int], dict[str, Any]]


def _plain(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if isinstance(cfg, DictConfig) else cfg


def num_updates(state: dict[str, Any]) -> int:
    history = state.get("optimizer_history") or [{}]
    return int(history[-1].get("num_updates", -1))


def check_same_run(states: list[dict[str, Any]], names: list[str], what: str = "shards") -> None:
    """One line unless every state has the model settings, update count and parameter
    names of the first."""
    first, first_name = states[0], names[0]
    model_cfg = _plain((first.get("cfg") or {}).get("model"))
    for state, name in zip(states[1:], names[1:]):
        if _plain((state.get("cfg") or {}).get("model")) != model_cfg:
            raise TsConfigError(f"{name} and {first_name} have different model settings: {what} from different runs")
        if num_updates(state) != num_updates(first):
            raise TsConfigError(
                f"{name} is at update {num_updates(state)} but {first_name} at {num_updates(first)}: "
                f"{what} from different runs or steps"
            )
        if set(state["model"]) != set(first["model"]):
            raise TsConfigError(f"{name} and {first_name} hold different parameters: {what} from different runs")


# tensor parallelism ------------------------------------------------------------------------


def reshard_optimizer(
    states: list[dict[str, Any]], layout: dict, names: list[str] | None, size: int
) -> list[dict[str, Any]] | None:
    """The optimizer states of the new parts, or ``None`` when they cannot be mapped to
    parameters (no state, no recorded names, or moments not shaped like their parameter)."""
    optimizers = [s.get("last_optimizer_state") for s in states]
    if names is None or any(not isinstance(o, dict) or not isinstance(o.get("state"), dict) for o in optimizers):
        return None
    moments = [o["state"] for o in optimizers]
    if any(not isinstance(i, int) or i >= len(names) for i in moments[0]):
        return None
    new = [{**copy.deepcopy({k: v for k, v in optimizers[0].items() if k != "state"}), "state": {}}
           for _ in range(size)]
    for index, entry in moments[0].items():
        name = names[index]
        for rank in range(size):
            new[rank]["state"][index] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.shape != states[0]["model"][name].shape:
                    return None
                shards = (reshard([m[index][key] for m in moments], layout[name], size) if name in layout
                          else [value] * size)
            else:
                shards = [value] * size
            for rank in range(size):
                new[rank]["state"][index][key] = shards[rank]
    return new


def reshard_states(states: list[dict[str, Any]], size: int, names: list[str] | None = None) -> list[dict[str, Any]]:
    """The ``size`` parts of the tensor-parallel parts ``states`` (rank order) of one
    expert rank; see the module docstring."""
    names = names or [f"part {k}" for k in range(len(states))]
    records = [read_record(s) for s in states]
    record = records[0]
    if record.tp_layout is None:
        raise TsConfigError(
            "the checkpoint records no tensor-parallel layout (saved before ts-reshard existed): "
            "save it again with this plugin (e.g. one update with --restore-file, --reset-optimizer)"
        )
    n = len(states)
    if record.tp_size != n:
        raise TsConfigError(f"found {n} checkpoint part(s) but the checkpoint was saved at size {record.tp_size}: "
                            "some part files are missing or extra")
    for k, (other, name) in enumerate(zip(records, names)):
        if other.tp_rank not in (None, k) or other.ep_rank != record.ep_rank:
            raise TsConfigError(
                f"{name} records tensor-parallel rank {other.tp_rank} (expert shard {other.ep_rank}) where part {k} "
                f"of expert shard {record.ep_rank} belongs: parts from different runs or renamed files"
            )
    check_same_run(states, names, "parts")
    layout = record.tp_layout
    models = [s["model"] for s in states]
    new_models: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for key, value in models[0].items():
        if key in layout:
            for rank, shard in enumerate(reshard([m[key] for m in models], layout[key], size)):
                new_models[rank][key] = shard
        else:
            for rank in range(size):
                new_models[rank][key] = value
    optimizers = reshard_optimizer(states, layout, record.params, size)
    out = []
    for rank in range(size):
        state = copy.deepcopy({k: v for k, v in states[0].items() if k not in ("model", "last_optimizer_state")})
        state["cfg"] = _plain(state.get("cfg"))
        state["model"] = new_models[rank]
        if optimizers is not None:
            state["last_optimizer_state"] = optimizers[rank]
        write_record(state, dataclasses.replace(record, tp_size=size, tp_rank=rank, rng={}))
        out.append(state)
    return out


def reshard_grid(grid: Grid, tp_size: int, ep_size: int, size: int, names: dict | None = None) -> Grid:
    """:func:`reshard_states` for every expert rank of a ``tp_size x ep_size`` grid."""
    out: Grid = {}
    for r in range(ep_size):
        parts = reshard_states([grid[(k, r)] for k in range(tp_size)], size,
                               [names[(k, r)] for k in range(tp_size)] if names else None)
        for k, state in enumerate(parts):
            out[(k, r)] = state
    return out


# expert parallelism ------------------------------------------------------------------------


def consolidate(states: list[dict], names: list[str]) -> dict:
    """The merged state of the expert shards ``states`` (any order) of one tensor-parallel
    rank; see the module docstring."""
    records = [read_record(s) for s in states]
    by_rank: dict[int, tuple[dict, str, CheckpointLayout]] = {}
    for state, name, record in zip(states, names, records):
        if record.ep_size != len(states):
            raise TsConfigError(
                f"{name} is one of {record.ep_size} shards but {len(states)} were given: pass every shard of one run"
            )
        if record.tp_rank != records[0].tp_rank:
            raise TsConfigError(
                f"{name} is tensor-parallel part {record.tp_rank} but {names[0]} part {records[0].tp_rank}: "
                "pass the shards of one part, or the checkpoint name"
            )
        if record.ep_rank in by_rank:
            raise TsConfigError(
                f"{name} and {by_rank[record.ep_rank][1]} are both rank {record.ep_rank}: shards from different runs"
            )
        by_rank[record.ep_rank] = (state, name, record)
    if sorted(by_rank) != list(range(len(states))):
        raise TsConfigError(f"shard ranks {sorted(by_rank)} do not cover 0..{len(states) - 1}: a shard is missing")
    ordered = [by_rank[r] for r in range(len(states))]
    check_same_run([s for s, _, _ in ordered], [n for _, n, _ in ordered])
    first, first_name, record = ordered[0]
    expert_keys = [k for k in first["model"] if record.is_expert_key(k)]
    if record.experts <= 0 or not expert_keys:
        raise TsConfigError(f"{first_name} has no experts (--moe-expert-count 0): nothing to consolidate")
    local = first["model"][expert_keys[0]].size(0)
    group = record.experts // local
    if group * local != record.experts or len(states) % group != 0:
        raise TsConfigError(
            f"{len(states)} shards with {local} experts each cannot hold {record.experts} experts: "
            "shards from different runs"
        )
    merged = {}
    for key, tensor in first["model"].items():
        if key in expert_keys:
            merged[key] = torch.cat([ordered[r][0]["model"][key] for r in range(group)])
            for r in range(group, len(states)):
                if not torch.equal(ordered[r][0]["model"][key], ordered[r % group][0]["model"][key]):
                    raise TsConfigError(f"{ordered[r][1]} holds an expert replica that differs: shards from different runs")
        else:
            for r in range(1, len(states)):
                if not torch.equal(ordered[r][0]["model"][key], tensor):
                    raise TsConfigError(
                        f"{ordered[r][1]} and {first_name} differ in the dense weight {key}: shards from different runs"
                    )
            merged[key] = tensor
    out = {k: v for k, v in first.items() if k != "last_optimizer_state"}
    out["model"] = merged
    out["cfg"] = _plain(out.get("cfg"))
    write_record(out, dataclasses.replace(record, ep_size=1, ep_rank=0, expert_tensors=expert_keys))
    return out


def consolidate_grid(grid: Grid, tp_size: int, ep_size: int, names: dict | None = None) -> Grid:
    """:func:`consolidate` for every tensor-parallel rank of a ``tp_size x ep_size`` grid."""
    return {
        (k, 0): consolidate([grid[(k, r)] for r in range(ep_size)],
                            [names[(k, r)] if names else f"part {k} shard {r}" for r in range(ep_size)])
        for k in range(tp_size)
    }
