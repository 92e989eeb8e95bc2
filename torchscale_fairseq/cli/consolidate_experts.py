"""``ts-consolidate-experts``: merge the per-rank shards of an expert-parallel checkpoint
(``checkpoint_X-shard<r>.pt``) into one checkpoint that ``fairseq-generate`` and
``fairseq-eval-lm`` load on a single process.

Rank ``r`` of an all-to-all group of ``A`` ranks holds experts ``r*E/A ... (r+1)*E/A-1``
of every MoE layer (``A = min(W, E)``), so the expert tensors of ranks ``0 .. A-1`` are
concatenated along the expert dimension; dense tensors are taken from rank 0. Shards are
refused with a one-line error unless they come from one run and one step: same model
settings, same update count, identical dense weights, identical expert replicas, and
exactly one shard for every rank. The optimizer state (sharded) is not kept.

Usage: ``ts-consolidate-experts CHECKPOINT_DIR/checkpoint_best.pt -o OUT.pt`` (the shards
``checkpoint_best-shard*.pt`` are found) or ``ts-consolidate-experts SHARD... -o OUT.pt``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

import torch
from omegaconf import DictConfig, OmegaConf

from torchscale_fairseq.errors import TsConfigError, install_excepthook

EXPERT_KEY = re.compile(r"\.experts\.")


def find_shards(paths: list[str]) -> list[str]:
    if len(paths) == 1 and not os.path.exists(paths[0]):
        stem = paths[0].removesuffix(".pt")
        found = sorted(glob.glob(f"{glob.escape(stem)}-shard*.pt"))
        if not found:
            raise TsConfigError(f"no checkpoint {paths[0]} and no shards {stem}-shard*.pt: check the path")
        return found
    return list(paths)


def _get(cfg, *keys):
    for k in keys:
        cfg = cfg[k] if cfg is not None and k in cfg else None
    return cfg


def _plain(cfg) -> object:
    return OmegaConf.to_container(cfg) if isinstance(cfg, DictConfig) else cfg


def _num_updates(state: dict) -> int:
    history = state.get("optimizer_history") or [{}]
    return int(history[-1].get("num_updates", -1))


def consolidate(states: list[dict], names: list[str]) -> dict:
    """The merged checkpoint of ``states`` (shards in any order); see the module docstring."""
    by_rank: dict[int, tuple[dict, str]] = {}
    for state, name in zip(states, names):
        rank = _get(state.get("cfg"), "distributed_training", "distributed_rank")
        world = _get(state.get("cfg"), "distributed_training", "distributed_world_size")
        if rank is None or world is None:
            raise TsConfigError(f"{name} records no distributed rank: it is not an expert-parallel shard")
        if world != len(states):
            raise TsConfigError(
                f"{name} is one of {world} shards but {len(states)} were given: pass every shard of one run"
            )
        if rank in by_rank:
            raise TsConfigError(f"{name} and {by_rank[rank][1]} are both rank {rank}: shards from different runs")
        by_rank[rank] = (state, name)
    if sorted(by_rank) != list(range(len(states))):
        raise TsConfigError(f"shard ranks {sorted(by_rank)} do not cover 0..{len(states) - 1}: a shard is missing")
    first, first_name = by_rank[0]
    model_cfg = _plain(_get(first["cfg"], "model"))
    for rank in range(1, len(states)):
        state, name = by_rank[rank]
        if _plain(_get(state["cfg"], "model")) != model_cfg:
            raise TsConfigError(f"{name} and {first_name} have different model settings: shards from different runs")
        if _num_updates(state) != _num_updates(first):
            raise TsConfigError(
                f"{name} is at update {_num_updates(state)} but {first_name} at {_num_updates(first)}: "
                "shards from different runs or steps"
            )
        if set(state["model"]) != set(first["model"]):
            raise TsConfigError(f"{name} and {first_name} hold different parameters: shards from different runs")
    num_experts = int(model_cfg.get("moe_expert_count", 0) or 0)
    expert_keys = [k for k in first["model"] if EXPERT_KEY.search(k)]
    if num_experts <= 0 or not expert_keys:
        raise TsConfigError(f"{first_name} has no experts (--moe-expert-count 0): nothing to consolidate")
    local = first["model"][expert_keys[0]].size(0)
    group = num_experts // local
    if group * local != num_experts or len(states) % group != 0:
        raise TsConfigError(
            f"{len(states)} shards with {local} experts each cannot hold {num_experts} experts: "
            "shards from different runs"
        )
    merged = {}
    for key, tensor in first["model"].items():
        if EXPERT_KEY.search(key):
            merged[key] = torch.cat([by_rank[r][0]["model"][key] for r in range(group)])
            for r in range(group, len(states)):
                if not torch.equal(by_rank[r][0]["model"][key], by_rank[r % group][0]["model"][key]):
                    raise TsConfigError(
                        f"{by_rank[r][1]} holds an expert replica that differs: shards from different runs"
                    )
        else:
            for r in range(1, len(states)):
                if not torch.equal(by_rank[r][0]["model"][key], tensor):
                    raise TsConfigError(
                        f"{by_rank[r][1]} and {first_name} differ in the dense weight {key}: shards from different runs"
                    )
            merged[key] = tensor
    out = {k: v for k, v in first.items() if k != "last_optimizer_state"}
    out["model"] = merged
    cfg = out["cfg"]
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    cfg["distributed_training"]["distributed_world_size"] = 1
    cfg["distributed_training"]["distributed_rank"] = 0
    out["cfg"] = cfg
    return out


def main(argv: list[str] | None = None) -> None:
    install_excepthook()
    parser = argparse.ArgumentParser(prog="ts-consolidate-experts", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="the shards, or the checkpoint name without -shardN")
    parser.add_argument("-o", "--output", required=True, help="consolidated checkpoint to write")
    args = parser.parse_args(argv)
    from fairseq import checkpoint_utils

    import torchscale_fairseq  # noqa: F401  (safe-load allow-list, registrations)

    names = find_shards(args.checkpoints)
    for name in names:
        if not os.path.isfile(name):
            raise TsConfigError(f"{name} does not exist")
    states = [checkpoint_utils.load_checkpoint_to_cpu(n) for n in names]
    merged = consolidate(states, names)
    checkpoint_utils.torch_persistent_save(merged, args.output)
    print(f"consolidated {len(names)} shards into {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
