"""How a sharded checkpoint is named, described and checked: one layout for tensor-parallel
parts, pipeline stages and expert shards.

Names. A checkpoint ``NAME.pt`` saved by ``T`` tensor-parallel ranks and ``P`` pipeline stages
whose experts are spread over ``S`` data-parallel ranks is the grid of files
``NAME{base}{-model_part-k if T > 1}{-stage p if P > 1}{-shard r if S > 1}.pt`` for ``k < T``,
``p < P``, ``r < S`` (:func:`checkpoint_suffix`; ``base`` is the user's ``--checkpoint-suffix``).
A stage's file names its layers by their global index (``decoder.layers.i``, ``ts_mlm``'s
``encoder.encoder.layers.i``), as one process does: a stage's modules are named as one process's.

Record. Every file holds ``extra_state["ts_tensor_parallel"]`` (:func:`describe`)::

    {"size": T, "rank": k, "layout": {name: {"dim", "stride", "vocab"}},
     "params": [trainable parameter names, optimizer order], "rng": tracker state,
     "expert_parallel": {"size": S, "rank": r, "experts": E, "tensors": [expert names]},
     "pipeline": {"size": P, "rank": p, "virtual": V, "counts": [layers per global stage],
                  "stack": "decoder.", "tied": [copy, original] or None}}

``params`` is the order of the optimizer state: one process's parameter order, restricted to the
file's stage (the last stage's copy of a tied embedding, last, added), since a stage's modules are
named and registered as one process's (:mod:`torchscale_fairseq.architecture.pipeline_stage`).
Loading refuses optimizer state recorded in another order than the model's
(:func:`check_optimizer_order`). ``stack`` is the prefix of the layer stack a pipeline splits
(its layers ``{stack}layers.i``, its embedding ``{stack}embed.``, the first stage's; every other
tensor the last stage's) and ``tied`` names the last stage's copy of a tied embedding and the
embedding it copies.

``layout`` says which tensors are split along which dimension with which stride and which
dimension is a padded vocabulary (:mod:`torchscale_fairseq.model_parallel.partition`);
expert tensors stack a rank's local experts along dimension 0 (:data:`EXPERT_DIM`); experts
split by tensor parallelism (``--moe-expert-tensor-parallel split``) are also in ``layout``,
with their split dimension (> 0), so resharding and consolidation are independent.
Checkpoints saved before ``expert_parallel`` and ``rank`` were recorded are read from
their config (:func:`read_record`): the tensor-parallel size from
``cfg.common.model_parallel_size``, both ranks from the global rank and world size
(tensor-parallel groups are consecutive ranks, Megatron-LM appendix B.1), the expert
count from ``cfg.model.moe_expert_count``.

Checkpoints without ``pipeline`` are one stage.

Checks. :func:`check_tensor_parallel_size`, :func:`check_pipeline_size`,
:func:`check_expert_shards` and :func:`check_checkpoint_name` refuse a mismatched load with one
line naming the conversion command (``ts-reshard``, ``ts-consolidate-experts``);
:func:`check_optimizer_order` refuses optimizer state in another parameter order.
"""

from __future__ import annotations

import copy
import glob
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import expert_parallel_size, is_expert
from torchscale_fairseq.model_parallel.parallel_context import parallel_groups_layout
from torchscale_fairseq.model_parallel.partition import layout

RECORD_KEY = "ts_tensor_parallel"
EXPERT_RECORD_KEY = "expert_parallel"
PIPELINE_RECORD_KEY = "pipeline"
PART_SUFFIX = "-model_part-"
STAGE_SUFFIX = "-stage"
SHARD_SUFFIX = "-shard"
EXPERT_DIM = 0
LEGACY_EXPERT_KEY = re.compile(r"\.experts\.")  # expert tensors of checkpoints without a record
RESHARD_COMMAND = "ts-reshard"
CONSOLIDATE_COMMAND = "ts-consolidate-experts"

_SUFFIX = re.compile(
    rf"^(?P<base>.*?)(?:{PART_SUFFIX}(?P<part>\d+))?(?:{STAGE_SUFFIX}(?P<stage>\d+))?(?:{SHARD_SUFFIX}(?P<shard>\d+))?$")
Position = tuple[int, int, int]  # (tensor-parallel rank, pipeline stage, expert shard) of one file


LAYER_KEY = re.compile(r"^((?:.*?\.)?layers\.)(\d+)\.")  # a stack's layers: ``{stack}layers.{global index}.``


def layer_indices(keys: Iterable[str]) -> dict[str, list[int]]:
    """The layer indices in ``keys`` per layer-stack prefix (``{"decoder.layers.": [0, 1]}``)."""
    found: dict[str, set[int]] = {}
    for key in keys:
        match = LAYER_KEY.match(key)
        if match:
            found.setdefault(match.group(1), set()).add(int(match.group(2)))
    return {prefix: sorted(indices) for prefix, indices in found.items()}


# names ---------------------------------------------------------------------------------


def checkpoint_suffix(tp_rank: int, tp_size: int, ep_rank: int, ep_size: int, base_suffix: str = "",
                      pp_rank: int = 0, pp_size: int = 1) -> str:
    """``base_suffix`` + ``-model_part-{tp_rank}`` when ``tp_size > 1`` + ``-stage{pp_rank}`` when
    ``pp_size > 1`` + ``-shard{ep_rank}`` when ``ep_size > 1`` (one rank's file is ``NAME{suffix}.pt``)."""
    suffix = base_suffix
    if tp_size > 1:
        suffix += f"{PART_SUFFIX}{tp_rank}"
    if pp_size > 1:
        suffix += f"{STAGE_SUFFIX}{pp_rank}"
    if ep_size > 1:
        suffix += f"{SHARD_SUFFIX}{ep_rank}"
    return suffix


def split_suffix(suffix: str) -> tuple[str, int | None, int | None, int | None]:
    """``(base, tp_rank, pp_rank, ep_rank)`` of a suffix made by :func:`checkpoint_suffix` (a
    rank is ``None`` when its part is absent)."""
    match = _SUFFIX.match(suffix)
    ranks = (match.group(key) for key in ("part", "stage", "shard"))
    return (match.group("base"), *(None if rank is None else int(rank) for rank in ranks))


def file_name(name: str, tp_rank: int, tp_size: int, ep_rank: int, ep_size: int, pp_rank: int = 0,
              pp_size: int = 1) -> str:
    """The file of rank ``(tp_rank, pp_rank, ep_rank)`` of checkpoint ``name`` (``NAME.pt``)."""
    return f"{name[:-3]}{checkpoint_suffix(tp_rank, tp_size, ep_rank, ep_size, '', pp_rank, pp_size)}.pt"


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one checkpoint: ``paths[(tp_rank, pp_rank, ep_rank)]`` over a full grid."""

    name: str
    tp_size: int
    ep_size: int
    paths: dict[Position, str]
    pp_size: int = 1


def _grid_positions(name: str) -> dict[tuple[int | None, int | None, int | None], str]:
    """Every file ``NAME{-model_part-k}{-stage p}{-shard r}.pt`` that exists, by ``(k, p, r)``."""
    stem = name[:-3]
    found = {}
    for path in glob.glob(f"{glob.escape(stem)}*.pt"):
        rest = path[len(stem):-3]
        base, *position = split_suffix(rest)
        if base == "":
            found[tuple(position)] = path
    return found


def has_saved_files(name: str) -> bool:
    """Whether any file of checkpoint ``name`` (``NAME.pt``, a part or a shard) exists."""
    return bool(_grid_positions(name))


_UPDATE_CHECKPOINT = re.compile(r"^checkpoint_\d+_(?P<update>\d+)$")


def newest_complete_checkpoint(save_dir: str, at_most: int, base_suffix: str = "") -> str | None:
    """The newest of fairseq's interval checkpoints ``checkpoint_E_U{base_suffix}.pt`` in
    ``save_dir`` with ``U <= at_most`` whose every part and shard exists, as the
    ``--restore-file`` that names it (``save_dir/checkpoint_E_U.pt``), or ``None``."""
    best: tuple[int, str] | None = None
    for path in glob.glob(os.path.join(glob.escape(save_dir), "checkpoint_*.pt")):
        base = split_suffix(os.path.basename(path)[:-3])[0]
        if base_suffix and not base.endswith(base_suffix):
            continue
        match = _UPDATE_CHECKPOINT.match(base[:len(base) - len(base_suffix)])
        if match is None or int(match["update"]) > at_most or (best and int(match["update"]) <= best[0]):
            continue
        try:
            find_checkpoint_files(os.path.join(save_dir, f"{base}.pt"))
        except TsConfigError:
            continue
        best = (int(match["update"]), os.path.join(save_dir, f"{match.group(0)}.pt"))
    return None if best is None else best[1]


def find_checkpoint_files(name: str, flag: str = "the checkpoint name") -> CheckpointFiles:
    """All files of checkpoint ``name`` (``NAME.pt``, as fairseq names it) as a full
    ``(tp_rank, pp_rank, ep_rank)`` grid; one-line errors for a part, stage or shard named instead
    of the checkpoint, nothing found, files of two layouts, and a missing file."""
    if not name.endswith(".pt"):
        raise TsConfigError(f"{name} is not a checkpoint name ending in .pt: check {flag}")
    if any(rank is not None for rank in split_suffix(os.path.basename(name)[:-3])[1:]):
        raise TsConfigError(
            f"{name} names one file of a sharded checkpoint: pass the checkpoint name without "
            f"'{PART_SUFFIX}K', '{STAGE_SUFFIX}P' and '{SHARD_SUFFIX}R'"
        )
    found = _grid_positions(name)
    if not found:
        raise TsConfigError(
            f"no checkpoint {name} (nor its parts {name[:-3]}{PART_SUFFIX}K.pt, stages {name[:-3]}{STAGE_SUFFIX}P.pt "
            f"or shards {name[:-3]}{SHARD_SUFFIX}R.pt): check {flag}"
        )
    kinds = {tuple(rank is not None for rank in position) for position in found}
    if len(kinds) > 1:
        shown = ", ".join(sorted(os.path.basename(p) for p in found.values())[:4])
        raise TsConfigError(
            f"{name} has files of different layouts ({shown}): move the files of other runs out of "
            f"{os.path.dirname(name) or '.'}"
        )
    tp_size, pp_size, ep_size = (1 + max(position[axis] or 0 for position in found) for axis in range(3))
    parted, staged, sharded = kinds.pop()
    paths = {}
    for k in range(tp_size):
        for p in range(pp_size):
            for r in range(ep_size):
                key = (k if parted else None, p if staged else None, r if sharded else None)
                if key not in found:
                    missing = file_name(name, k, tp_size, r, ep_size, p, pp_size)
                    raise TsConfigError(f"{missing} is missing: a checkpoint part, stage or expert shard is incomplete")
                paths[(k, p, r)] = found[key]
    return CheckpointFiles(name, tp_size, ep_size, paths, pp_size)


# record --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineRecord:
    """The pipeline stage a file holds: ``rank`` of ``size`` ranks with ``virtual`` chunks each,
    ``counts`` the layers of every global stage (``None``: one stage, the whole stack); ``stack``
    the prefix of the layer stack (``None``: a model without one, or saved before it was recorded),
    ``tied`` the names ``(copy, original)`` of a tied embedding's last-stage copy and the embedding."""

    size: int = 1
    rank: int = 0
    virtual: int = 1
    counts: tuple[int, ...] | None = None
    stack: str | None = None
    tied: tuple[str, str] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"size": self.size, "rank": self.rank, "virtual": self.virtual,
                "counts": None if self.counts is None else list(self.counts), "stack": self.stack,
                "tied": None if self.tied is None else list(self.tied)}

    @classmethod
    def from_dict(cls, record: dict[str, Any] | None) -> PipelineRecord:
        if not record:
            return cls()
        counts, tied = record.get("counts"), record.get("tied")
        return cls(int(record["size"]), int(record["rank"]), int(record.get("virtual") or 1),
                   None if counts is None else tuple(int(c) for c in counts), record.get("stack"),
                   None if tied is None else (str(tied[0]), str(tied[1])))


@dataclass(frozen=True)
class CheckpointLayout:
    """What one checkpoint file holds (see the module docstring). ``ep_size`` counts the
    expert shards (1: all experts in this file); ``experts`` is the total expert count
    (0: dense); ``tp_layout`` is the record's ``layout`` (``None`` when none was recorded:
    saved before ``ts-reshard`` existed), ``params`` its optimizer-order parameter names,
    ``expert_tensors`` the expert tensor names (``None``: found by name pattern);
    ``tp_rank`` ``None`` when neither recorded nor configured."""

    tp_size: int = 1
    tp_rank: int | None = 0
    ep_size: int = 1
    ep_rank: int = 0
    experts: int = 0
    tp_layout: dict[str, dict[str, int | None]] | None = None
    params: list[str] | None = None
    expert_tensors: list[str] | None = None
    rng: dict = field(default_factory=dict)
    pipeline: PipelineRecord = field(default_factory=PipelineRecord)

    def is_expert_key(self, key: str) -> bool:
        if self.expert_tensors is not None:
            return key in self.expert_tensors
        return bool(LEGACY_EXPERT_KEY.search(key))


def expert_count(model: torch.nn.Module) -> int:
    """``E``: a rank's local experts (dimension 0 of an expert tensor) times the ranks of
    its all-to-all group (the expert-parallel size the parameter is tagged with)."""
    for param in model.parameters():
        if is_expert(param):
            return param.size(EXPERT_DIM) * expert_parallel_size(param)
    return 0


def optimizer_order(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s trainable parameters in the order fairseq's optimizer holds them."""
    return [key for key, p in model.named_parameters() if p.requires_grad]


def describe(
    model: torch.nn.Module, tp_size: int, tp_rank: int, ep_size: int, ep_rank: int, rng_state: dict,
    pipeline: PipelineRecord | None = None,
) -> dict[str, Any]:
    """The record of the module docstring, for ``extra_state[RECORD_KEY]``; ``ep_size``
    is the number of expert shards (1 unless every data-parallel rank saves its own)."""
    expert_names = {id(p) for p in model.parameters() if is_expert(p)}
    return {
        "size": tp_size,
        "rank": tp_rank,
        "layout": layout(model),
        "params": optimizer_order(model),
        "rng": rng_state,
        EXPERT_RECORD_KEY: {
            "size": ep_size,
            "rank": ep_rank,
            "experts": expert_count(model),
            "tensors": [key for key, p in model.named_parameters(remove_duplicate=False) if id(p) in expert_names],
        },
        PIPELINE_RECORD_KEY: (pipeline or PipelineRecord()).as_dict(),
    }


def _get(cfg: Any, *keys: str) -> Any:
    for key in keys:
        cfg = cfg.get(key) if cfg is not None and hasattr(cfg, "get") else None
    return cfg


def saved_model_parallel_size(state: dict[str, Any]) -> int:
    """The tensor-parallel size a checkpoint was saved at (1 when unrecorded)."""
    size = _get(state.get("cfg"), "common", "model_parallel_size")
    if size is None:
        size = getattr(state.get("args"), "model_parallel_size", None)
    return int(size or 1)


def read_record(state: dict[str, Any]) -> CheckpointLayout:
    """The :class:`CheckpointLayout` of a loaded checkpoint, from its record or, for a
    checkpoint saved before the record had ``rank`` and ``expert_parallel``, from its config."""
    recorded = (state.get("extra_state") or {}).get(RECORD_KEY) or {}
    cfg = state.get("cfg")
    tp_size = int(recorded.get("size") or saved_model_parallel_size(state))
    experts = int(_get(cfg, "model", "moe_expert_count") or getattr(state.get("args"), "moe_expert_count", 0) or 0)
    expert_record = recorded.get(EXPERT_RECORD_KEY)
    if expert_record is not None and "rank" in recorded:
        tp_rank, ep_size, ep_rank = int(recorded["rank"]), int(expert_record["size"]), int(expert_record["rank"])
        experts, expert_tensors = int(expert_record["experts"]), list(expert_record["tensors"])
    else:
        tp_rank, ep_size, ep_rank = _ranks_from_config(state, tp_size, experts)
        expert_tensors = None
    return CheckpointLayout(tp_size, tp_rank, ep_size, ep_rank, experts, recorded.get("layout"),
                            recorded.get("params"), expert_tensors, recorded.get("rng") or {},
                            PipelineRecord.from_dict(recorded.get(PIPELINE_RECORD_KEY)))


def _ranks_from_config(state: dict[str, Any], tp_size: int, experts: int) -> tuple[int | None, int, int]:
    """``(tp_rank, ep_size, ep_rank)`` from the global rank and world size: experts are
    sharded when the model has experts and more than one data-parallel rank (a config
    without them: one unsharded file, ``tp_rank`` unknown at ``tp_size > 1``)."""
    cfg = state.get("cfg")
    world = _get(cfg, "distributed_training", "distributed_world_size")
    rank = _get(cfg, "distributed_training", "distributed_rank")
    if world is None or rank is None:
        return (0 if tp_size == 1 else None), 1, 0
    world, rank = int(world), int(rank)
    if world % tp_size != 0 or not 0 <= rank < world:
        raise TsConfigError(
            f"the checkpoint records rank {rank} of {world} at --model-parallel-size {tp_size}, which is not a "
            "valid layout: it was not saved by fairseq-train with this plugin"
        )
    groups = parallel_groups_layout(world, tp_size)
    tp_rank = next(g.index(rank) for g in groups.tensor if rank in g)
    dp_rank = next(g.index(rank) for g in groups.data if rank in g)
    dp_size = world // tp_size
    if experts > 0 and dp_size > 1:
        return tp_rank, dp_size, dp_rank
    return tp_rank, 1, 0


def write_record(state: dict[str, Any], new: CheckpointLayout) -> None:
    """Make ``state`` describe ``new``: the record, and the config fields fairseq and
    :func:`read_record` read (sizes, ranks, checkpoint suffix), where present."""
    extra_state = dict(state.get("extra_state") or {})
    record = {
        **(extra_state.get(RECORD_KEY) or {}),
        "size": new.tp_size,
        "rank": new.tp_rank,
        "params": new.params,
        "rng": new.rng,
        EXPERT_RECORD_KEY: {"size": new.ep_size, "rank": new.ep_rank, "experts": new.experts,
                            "tensors": sorted(k for k in state.get("model", {}) if new.is_expert_key(k))},
        PIPELINE_RECORD_KEY: new.pipeline.as_dict(),
    }
    if new.tp_layout is not None:
        record["layout"] = new.tp_layout
    state["extra_state"] = {**extra_state, RECORD_KEY: record}
    state["cfg"] = cfg = copy.deepcopy(state.get("cfg"))
    pipe = new.pipeline
    if cfg is not None:
        if cfg.get("common") is not None:
            cfg["common"]["model_parallel_size"] = new.tp_size
        distributed = cfg.get("distributed_training")
        if distributed is not None:
            if "model_parallel_size" in distributed:
                distributed["model_parallel_size"] = new.tp_size
            distributed["distributed_world_size"] = new.tp_size * new.ep_size * pipe.size
            distributed["distributed_rank"] = new.tp_rank + new.tp_size * (new.ep_rank + new.ep_size * pipe.rank)
        if cfg.get("checkpoint") is not None:
            base = split_suffix(cfg["checkpoint"].get("checkpoint_suffix") or "")[0]
            cfg["checkpoint"]["checkpoint_suffix"] = checkpoint_suffix(new.tp_rank, new.tp_size, 0, 1, base)
        model = cfg.get("model")
        if model is not None and "pipeline_model_parallel_size" in model:
            model["pipeline_model_parallel_size"] = pipe.size
            model["virtual_pipeline_stages"] = pipe.virtual
            counts = pipe.counts
            model["pipeline_layers"] = (",".join(map(str, counts)) if counts and len(set(counts)) > 1 else None)
    if state.get("args") is not None:
        state["args"] = copy.copy(state["args"])
        state["args"].model_parallel_size = new.tp_size


# checks --------------------------------------------------------------------------------


def checkpoint_name(path: str) -> str:
    """The checkpoint name (``NAME.pt``) of one of its files."""
    directory, base = os.path.split(path)
    return os.path.join(directory, split_suffix(base[:-3])[0] + ".pt") if base.endswith(".pt") else path


def reshard_hint(path: str, saved: int, wanted: int) -> str:
    """The one line for parts saved at tensor-parallel size ``saved`` loaded at ``wanted``."""
    name = checkpoint_name(path)
    return (
        f"{path} was saved at --model-parallel-size {saved} but this run uses {wanted}: "
        f"reshard it first with `{RESHARD_COMMAND} --input {name} --size {wanted} --output NEW.pt` (then use NEW.pt)"
    )


def consolidate_hint(path: str, saved: int, wanted: int) -> str:
    """The one line for a file of ``saved`` expert shards loaded where ``wanted`` are used."""
    name = checkpoint_name(path)
    return (
        f"{path} is one of {saved} expert shards but this run uses {wanted}: merge them first with "
        f"`{CONSOLIDATE_COMMAND} {name} -o NEW.pt` (then use NEW.pt)"
    )


def check_tensor_parallel_size(state: dict[str, Any], path: str, wanted: int) -> None:
    """Refuse parts saved at another tensor-parallel size."""
    saved = saved_model_parallel_size(state)
    if saved != wanted:
        raise TsConfigError(reshard_hint(path, saved, wanted))


def check_pipeline_size(state: dict[str, Any], path: str, wanted: int) -> None:
    """Refuse a stage saved at another pipeline size (the layers of one stage are checked
    against the model's by :func:`~torchscale_fairseq.models.checkpoint_checks.check_layers`)."""
    saved = read_record(state).pipeline.size
    if saved != wanted:
        raise TsConfigError(
            f"{path} was saved at --pipeline-model-parallel-size {saved} but this run uses {wanted}: convert it first "
            f"with `{RESHARD_COMMAND} --input {checkpoint_name(path)} --pipeline-size {wanted} --output NEW.pt` "
            "(then use NEW.pt)"
        )


def check_optimizer_order(saved: list[str] | None, model: torch.nn.Module, path: str) -> None:
    """Refuse optimizer state recorded (``saved``, the record's ``params``) for another parameter
    order than ``model``'s: its moments would be given to other parameters (``None``: not recorded)."""
    own = optimizer_order(model)
    if saved is None or list(saved) == own:
        return
    at = next((i for i, (a, b) in enumerate(zip(saved, own)) if a != b), min(len(saved), len(own)))
    theirs, ours = (names[at] if at < len(names) else "nothing" for names in (saved, own))
    raise TsConfigError(
        f"{path} holds optimizer state for {len(saved)} parameters in another order than this model's {len(own)} "
        f"(position {at}: {theirs} there, {ours} here), so its moments would go to other parameters: resume with "
        "--reset-optimizer, or from a checkpoint this model saved"
    )


def check_expert_shards(state: dict[str, Any], path: str, wanted: int) -> None:
    """Refuse a file of ``S`` expert shards where ``wanted`` shards are used (a
    consolidated checkpoint, ``S = 1``, needs ``wanted = 1``; its experts can be sharded again
    only by training, so the hint names consolidation only when ``wanted`` is 1)."""
    record = read_record(state)
    if record.ep_size == wanted:
        return
    if wanted == 1:
        raise TsConfigError(consolidate_hint(path, record.ep_size, wanted))
    raise TsConfigError(
        f"{path} holds the experts of {record.ep_size} data-parallel rank(s) but this run has {wanted}: "
        f"resume with {record.ep_size} data-parallel ranks per tensor-parallel rank, or start from "
        f"`{CONSOLIDATE_COMMAND}`'s output with --restore-file and --reset-optimizer"
    )


def check_checkpoint_name(filename: str, wanted: int) -> None:
    """One line for a checkpoint name that does not match ``--model-parallel-size``
    ``wanted`` when fairseq's file for it is missing: a part or stage named instead of the
    checkpoint, a single file loaded with ``wanted > 1``, parts loaded with ``wanted = 1``,
    pipeline stages loaded by a tool that runs one stage (``fairseq-eval-lm``, ``fairseq-generate``)."""
    base = os.path.basename(filename)
    if PART_SUFFIX in base or re.search(rf"{STAGE_SUFFIX}\d+(?:{SHARD_SUFFIX}\d+)?\.pt$", base):
        raise TsConfigError(
            f"{filename} names one checkpoint part or pipeline stage: pass the name without '{PART_SUFFIX}K' "
            f"and '{STAGE_SUFFIX}P' (fairseq appends each rank's suffix itself)"
        )
    stages = [position for position in _grid_positions(filename) if position[1] is not None]
    if stages:
        count = 1 + max(position[1] for position in stages)
        raise TsConfigError(
            f"{filename} was saved as {count} pipeline stages ({filename[:-3]}{STAGE_SUFFIX}P.pt): merge them first with "
            f"`{RESHARD_COMMAND} --input {filename} --pipeline-size 1 --size {wanted} --output NEW.pt` (then use NEW.pt)"
        )
    if wanted > 1 and os.path.exists(filename):
        raise TsConfigError(reshard_hint(filename, 1, wanted))
    if wanted == 1 and os.path.exists(f"{filename[:-3]}{PART_SUFFIX}0.pt"):
        saved = 1
        while os.path.exists(f"{filename[:-3]}{PART_SUFFIX}{saved}.pt"):
            saved += 1
        raise TsConfigError(reshard_hint(filename, saved, wanted))
