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

- :func:`merge_stages`: the ``P`` pipeline stages of one tensor-parallel rank and expert shard
  to one state (a stage's tensors are named as one process's, so the model is the union of the
  stages' tensors; the last stage's copy of a tied embedding, named by the record, must equal the
  first stage's embedding and is dropped); tensors and optimizer moments go into one process's
  order (:func:`one_process_order`). :func:`split_stages` is its inverse for a split given as
  layer counts per global stage (``--pipeline-layers``; even by default): each stage keeps one
  process's order restricted to its tensors, as its model has them.

A checkpoint with several kinds of shards is converted by applying each per rank of the
others (:func:`reshard_grid`, :func:`consolidate_grid`, :func:`repipeline_grid`); all in turn
give one file.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from torchscale_fairseq.checkpoints.layout import (
    LAYER_KEY,
    CheckpointLayout,
    PipelineRecord,
    layer_indices,
    read_record,
    write_record,
)
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.partition import reshard
from torchscale_fairseq.model_parallel.pipeline_parallel import chunk_layer_ranges, stage_layer_counts

# grids of loaded states: states[(tp_rank, pp_rank, ep_rank)]
Grid = dict[tuple[int, int, int], dict[str, Any]]


def _plain(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if isinstance(cfg, DictConfig) else cfg


def num_updates(state: dict[str, Any]) -> int:
    history = state.get("optimizer_history") or [{}]
    return int(history[-1].get("num_updates", -1))


def check_same_run(states: list[dict[str, Any]], names: list[str], what: str = "shards",
                   same_parameters: bool = True) -> None:
    """One line unless every state has the model settings, update count and (with
    ``same_parameters``) parameter names of the first."""
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
        if same_parameters and set(state["model"]) != set(first["model"]):
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


def reshard_grid(grid: Grid, tp_size: int, ep_size: int, size: int, names: dict | None = None,
                 pp_size: int = 1) -> Grid:
    """:func:`reshard_states` for every stage and expert rank of a ``tp_size x pp_size x ep_size`` grid."""
    out: Grid = {}
    for p in range(pp_size):
        for r in range(ep_size):
            parts = reshard_states([grid[(k, p, r)] for k in range(tp_size)], size,
                                   [names[(k, p, r)] for k in range(tp_size)] if names else None)
            for k, state in enumerate(parts):
                out[(k, p, r)] = state
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


def consolidate_grid(grid: Grid, tp_size: int, ep_size: int, names: dict | None = None, pp_size: int = 1) -> Grid:
    """:func:`consolidate` for every tensor-parallel rank and stage of a ``tp_size x pp_size x ep_size`` grid."""
    return {
        (k, p, 0): consolidate([grid[(k, p, r)] for r in range(ep_size)],
                               [names[(k, p, r)] if names else f"part {k} stage {p} shard {r}" for r in range(ep_size)])
        for k in range(tp_size) for p in range(pp_size)
    }


# pipeline parallelism ----------------------------------------------------------------------


def _recorded_stack(record: CheckpointLayout, name: str) -> PipelineRecord:
    """The pipeline record of ``name``, refused in one line when it names no layer stack."""
    if record.pipeline.stack is None:
        raise TsConfigError(
            f"{name} records no layer stack to split into pipeline stages (a model without one, or saved before the "
            "record named it): load it once with this plugin and save it again (e.g. one update with --restore-file)"
        )
    return record.pipeline


def one_process_order(orders: list[list[str]]) -> list[str]:
    """One process's order of the tensor names of its stages, each stage's ``orders`` entry being
    that order restricted to the stage: the pre-order of one module tree (a module's own tensors,
    then its submodules' in registration order), whose children named by a number (a stack's
    layers, keyed by global index) come in numeric order. Refused in one line when the stages do
    not determine it."""
    leaves = {tuple(name.split(".")) for order in orders for name in order}
    children: dict[tuple[str, ...], dict[str, None]] = {}
    before: dict[tuple[str, ...], dict[str, set[str]]] = {}
    for order in orders:
        for name in order:
            parts = tuple(name.split("."))
            for k in range(len(parts)):
                children.setdefault(parts[:k], {})[parts[k]] = None
        for a, b in zip(order, order[1:]):
            pa, pb = a.split("."), b.split(".")
            k = next(i for i, (x, y) in enumerate(zip(pa, pb)) if x != y)
            before.setdefault(tuple(pa[:k]), {}).setdefault(pa[k], set()).add(pb[k])
    out: list[str] = []

    def visit(node: tuple[str, ...]) -> None:
        for child in _sorted_children(node, list(children[node]), before.get(node, {})):
            path = (*node, child)
            if path in leaves:
                out.append(".".join(path))
            else:
                visit(path)

    visit(())
    return out


def _sorted_children(node: tuple[str, ...], names: list[str], before: dict[str, set[str]]) -> list[str]:
    """``names`` (the children of ``node``) in the one order that ``before`` (``a`` -> the names after
    it) and numeric order of numbered names allow (Kahn's topological sort, one choice at each step)."""
    after = {n: set(before.get(n, ())) for n in names}
    numbered = sorted((int(n), n) for n in names if n.isdigit())
    for (_, a), (_, b) in zip(numbered, numbered[1:]):
        after[a].add(b)
    waiting = {n: 0 for n in names}
    for n in names:
        for m in after[n]:
            waiting[m] += 1
    ready, order = [n for n in names if waiting[n] == 0], []
    while len(ready) == 1:
        order.append(ready.pop())
        for m in after[order[-1]]:
            waiting[m] -= 1
            if waiting[m] == 0:
                ready.append(m)
    if len(order) != len(names):
        where = ".".join(node) or "the model"
        raise TsConfigError(
            f"the stages' tensor orders do not give one order of {where}'s {', '.join(sorted(set(names) - set(order)))}:"
            " stages from different runs, or a stage module registered in another order than one process's"
        )
    return order


def _moved_optimizer(states: list[dict[str, Any]], records: list[CheckpointLayout], params: list[str],
                     source: dict[str, tuple[int, str]]) -> dict[str, Any] | None:
    """The optimizer state of a file whose parameters (optimizer order) are ``params``, each
    taken from ``source[name] = (state index, name there)``; ``None`` when the states cannot be
    mapped to parameters (no state, no recorded names, several parameter groups, moments not
    shaped like their parameter: fp16's flat master)."""
    optimizers = [s.get("last_optimizer_state") for s in states]
    if any(r.params is None for r in records) or any(
            not isinstance(o, dict) or not isinstance(o.get("state"), dict) or len(o.get("param_groups") or ()) != 1
            for o in optimizers):
        return None
    entries: dict[int, dict[str, Any]] = {}
    for j, name in enumerate(params):
        index, there = source[name]
        positions = {n: i for i, n in enumerate(records[index].params)}
        entry = optimizers[index]["state"].get(positions.get(there, -1))
        if entry is None:
            continue
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != states[index]["model"][there].shape:
                return None
        entries[j] = copy.deepcopy(entry)
    first = optimizers[0]
    groups = copy.deepcopy(first["param_groups"])
    groups[0]["params"] = list(range(len(params)))
    return {**{k: copy.deepcopy(v) for k, v in first.items() if k not in ("state", "param_groups")},
            "state": entries, "param_groups": groups}


def _rebuilt(template: dict[str, Any], model: dict[str, torch.Tensor], optimizer: dict[str, Any] | None,
             layout: CheckpointLayout) -> dict[str, Any]:
    """``template`` (a loaded state) holding ``model`` and ``optimizer``, recorded as ``layout``."""
    state = copy.deepcopy({k: v for k, v in template.items() if k not in ("model", "last_optimizer_state")})
    state["cfg"] = _plain(state.get("cfg"))
    state["model"] = model
    if optimizer is not None:
        state["last_optimizer_state"] = optimizer
    write_record(state, layout)
    return state


def merge_stages(states: list[dict[str, Any]], names: list[str] | None = None) -> dict[str, Any]:
    """The one-stage state of the pipeline stages ``states`` (stage order) of one tensor-parallel
    rank and expert shard; see the module docstring."""
    names = names or [f"stage {p}" for p in range(len(states))]
    records = [read_record(s) for s in states]
    first = records[0]
    for p, (record, name) in enumerate(zip(records, names)):
        if (record.pipeline.size, record.pipeline.rank) != (len(states), p) or (
                record.tp_rank, record.ep_rank) != (first.tp_rank, first.ep_rank):
            raise TsConfigError(
                f"{name} records pipeline stage {record.pipeline.rank} of {record.pipeline.size} (part {record.tp_rank}, "
                f"shard {record.ep_rank}) where stage {p} of {len(states)} belongs: stages from different runs or "
                "renamed files"
            )
    check_same_run(states, names, "stages", same_parameters=False)
    stack = _recorded_stack(first, names[0])
    copy, original = stack.tied or (None, None)
    model: dict[str, torch.Tensor] = {}
    owner: dict[str, tuple[int, str]] = {}
    for p, (state, name) in enumerate(zip(states, names)):
        for key, value in state["model"].items():
            if key == copy:
                continue
            if key in model and not torch.equal(model[key], value):
                raise TsConfigError(f"{name} and {names[owner[key][0]]} hold different {key}: stages from different runs")
            model.setdefault(key, value)
            owner.setdefault(key, (p, key))
    for state, name in zip(states, names):
        if copy in state["model"] and not torch.equal(state["model"][copy], model.get(original)):
            raise TsConfigError(f"{name}'s copy of the tied embedding differs from the first stage's: stages from "
                                "different runs or steps")
    order = one_process_order([[k for k in s["model"] if k != copy] for s in states])
    layers = layer_indices(order).get(f"{stack.stack}layers.", [])
    counts = first.pipeline.counts
    if counts is not None and layers != list(range(sum(counts))):
        raise TsConfigError(f"the stages hold layers {layers} but the pipeline split {list(counts)} has "
                            f"{sum(counts)}: a stage is missing or from another run")
    params = one_process_order([[n for n in r.params if n != copy] for r in records]) \
        if all(r.params is not None for r in records) else None
    for p, record in enumerate(records):
        for key in record.params or ():
            owner.setdefault(key, (p, key))
    optimizer = _moved_optimizer(states, records, params, owner) if params is not None else None
    tp_layout = None if any(r.tp_layout is None for r in records) else {
        k: v for r in records for k, v in r.tp_layout.items() if k != copy}
    experts = None if any(r.expert_tensors is None for r in records) else [
        k for k in order if any(k in r.expert_tensors for r in records)]
    layout = dataclasses.replace(first, params=params, tp_layout=tp_layout, expert_tensors=experts, rng={},
                                 pipeline=PipelineRecord(stack=stack.stack, tied=stack.tied))
    return _rebuilt(states[0], {k: model[k] for k in order}, optimizer, layout)


def split_stages(state: dict[str, Any], size: int, virtual: int = 1, counts: list[int] | None = None,
                 name: str = "the checkpoint") -> list[dict[str, Any]]:
    """The ``size`` pipeline stages (``virtual`` chunks each, ``counts`` layers per global stage or
    an even split) of the one-stage ``state``: the inverse of :func:`merge_stages`. A stage holds
    its layers, the first stage the stack's embedding, the last every other tensor and, with a
    tied embedding, a copy of it (last, as its model registers it)."""
    record = read_record(state)
    if record.pipeline.size != 1:
        raise TsConfigError(f"{name} is pipeline stage {record.pipeline.rank} of {record.pipeline.size}: merge the "
                            "stages first (pass the checkpoint name)")
    stack = _recorded_stack(record, name)
    model = state["model"]
    layers_prefix, embedding_prefix = f"{stack.stack}layers.", f"{stack.stack}embed."
    counts = stage_layer_counts(len(layer_indices(model).get(layers_prefix, [])), size * virtual, counts)
    copy, original = stack.tied if size > 1 and stack.tied is not None else (None, None)
    stages = []
    for p in range(size):
        held = {i for r in chunk_layer_ranges(counts, size, p) for i in r}

        def kept(key: str, p: int = p, held: set = held) -> bool:
            layer = LAYER_KEY.match(key)
            if layer is not None and layer.group(1) == layers_prefix:
                return int(layer.group(2)) in held
            return p == 0 if key.startswith(embedding_prefix) else p == size - 1

        stage_model = {k: v for k, v in model.items() if kept(k)}
        params = None if record.params is None else [n for n in record.params if kept(n)]
        source = {n: (0, n) for n in params or ()}
        tp_layout = None if record.tp_layout is None else {k: v for k, v in record.tp_layout.items() if kept(k)}
        if copy is not None and p == size - 1:
            stage_model[copy] = model[original].clone()
            if params is not None:
                params.append(copy)
                source[copy] = (0, original)
            if tp_layout is not None and original in record.tp_layout:
                tp_layout[copy] = record.tp_layout[original]
        optimizer = _moved_optimizer([state], [record], params, source) if params is not None else None
        experts = None if record.expert_tensors is None else [k for k in record.expert_tensors if kept(k)]
        layout = dataclasses.replace(record, params=params, tp_layout=tp_layout, expert_tensors=experts, rng={},
                                     pipeline=dataclasses.replace(stack, size=size, rank=p, virtual=virtual,
                                                                  counts=tuple(counts)))
        stages.append(_rebuilt(state, stage_model, optimizer, layout))
    return stages


def repipeline_grid(grid: Grid, tp_size: int, pp_size: int, ep_size: int, size: int, virtual: int = 1,
                    counts: list[int] | None = None, names: dict | None = None) -> Grid:
    """Every tensor-parallel rank and expert shard of a ``tp_size x pp_size x ep_size`` grid
    merged (:func:`merge_stages`) and split again into ``size`` stages (:func:`split_stages`)."""
    out: Grid = {}
    for k in range(tp_size):
        for r in range(ep_size):
            stages = [grid[(k, p, r)] for p in range(pp_size)]
            merged = merge_stages(stages, [names[(k, p, r)] for p in range(pp_size)] if names else None) \
                if pp_size > 1 else stages[0]
            for p, state in enumerate(split_stages(merged, size, virtual, counts) if size > 1 else [merged]):
                out[(k, p, r)] = state
    return out
