"""``ts-reshard``: convert a checkpoint between tensor-parallel sizes.

    ts-reshard --input ckpt/checkpoint_last.pt --size 1 --output one/checkpoint_last.pt

``--input`` names the checkpoint as fairseq does (without ``-model_part-K``): the parts
``NAME-model_part-K.pt`` of a size-N checkpoint or the single ``NAME.pt``. The output is
``OUTPUT`` for ``--size 1``, else ``OUTPUT`` with ``-model_part-K`` for every new rank K.
Sharded parameters follow the layout recorded in the checkpoint (split dimension,
Q/K/V stride, padded vocabulary), everything else is copied from part 0. Per-parameter
optimizer moments (Adam's ``exp_avg``/``exp_avg_sq``, ...) are resharded like their
parameters; an optimizer state that is not per-parameter (fp16's flat master copy) is
dropped, and training continues with ``--reset-optimizer``. The per-rank RNG streams are
reseeded.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

import torch

from torchscale_fairseq.compat.model_parallel_checkpoints import (
    PART_SUFFIX,
    saved_model_parallel_size,
)
from torchscale_fairseq.compat.model_parallel_trainer import TP_STATE_KEY
from torchscale_fairseq.compat.safe_checkpoints import register_safe_globals
from torchscale_fairseq.errors import TsConfigError, install_excepthook
from torchscale_fairseq.model_parallel.partition import reshard


def part_paths(name: str) -> list[str]:
    """The files of checkpoint ``name``: its parts in rank order, or ``[name]``."""
    if PART_SUFFIX in os.path.basename(name):
        raise TsConfigError(f"{name} names one part: pass the checkpoint name without '{PART_SUFFIX}K'")
    parts, k = [], 0
    while os.path.exists(f"{name[:-3]}{PART_SUFFIX}{k}.pt"):
        parts.append(f"{name[:-3]}{PART_SUFFIX}{k}.pt")
        k += 1
    if parts:
        return parts
    if os.path.exists(name):
        return [name]
    raise TsConfigError(f"no checkpoint {name} (nor {name[:-3]}{PART_SUFFIX}0.pt): check --input")


def output_paths(name: str, size: int) -> list[str]:
    return [name] if size == 1 else [f"{name[:-3]}{PART_SUFFIX}{k}.pt" for k in range(size)]


def _set_size(state: dict[str, Any], size: int, rank: int) -> None:
    cfg = state.get("cfg")
    if cfg is not None:
        cfg["common"]["model_parallel_size"] = size
        if "model_parallel_size" in (cfg.get("distributed_training") or {}):
            cfg["distributed_training"]["model_parallel_size"] = size
        suffix = cfg["checkpoint"].get("checkpoint_suffix") or ""
        suffix = suffix.split(PART_SUFFIX)[0]
        cfg["checkpoint"]["checkpoint_suffix"] = suffix + (f"{PART_SUFFIX}{rank}" if size > 1 else "")
    if state.get("args") is not None:
        state["args"].model_parallel_size = size


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


def reshard_states(states: list[dict[str, Any]], size: int) -> list[dict[str, Any]]:
    """The ``size`` checkpoint states of the tensor-parallel checkpoint ``states``."""
    n = len(states)
    recorded = (states[0].get("extra_state") or {}).get(TP_STATE_KEY)
    if recorded is None or "layout" not in recorded:
        raise TsConfigError(
            "the checkpoint records no tensor-parallel layout (saved before ts-reshard existed): "
            "save it again with this plugin (e.g. one update with --restore-file, --reset-optimizer)"
        )
    saved = saved_model_parallel_size(states[0])
    if saved != n:
        raise TsConfigError(f"found {n} checkpoint part(s) but the checkpoint was saved at size {saved}: "
                            "some part files are missing or extra")
    layout = recorded["layout"]
    models = [s["model"] for s in states]
    new_models: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for key, value in models[0].items():
        if key in layout:
            for rank, shard in enumerate(reshard([m[key] for m in models], layout[key], size)):
                new_models[rank][key] = shard
        else:
            for rank in range(size):
                new_models[rank][key] = value
    optimizers = reshard_optimizer(states, layout, recorded.get("params"), size)
    out = []
    for rank in range(size):
        state = copy.deepcopy({k: v for k, v in states[0].items() if k not in ("model", "last_optimizer_state")})
        state["model"] = new_models[rank]
        if optimizers is not None:
            state["last_optimizer_state"] = optimizers[rank]
        state["extra_state"][TP_STATE_KEY] = {**recorded, "size": size, "rng": {}}
        _set_size(state, size, rank)
        out.append(state)
    return out


def main(argv: list[str] | None = None) -> None:
    """Console entry point ``ts-reshard``."""
    install_excepthook()
    register_safe_globals()
    parser = argparse.ArgumentParser(prog="ts-reshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="checkpoint name, e.g. ckpt/checkpoint_last.pt")
    parser.add_argument("--size", type=int, required=True, help="the new --model-parallel-size")
    parser.add_argument("--output", required=True, help="new checkpoint name (parts get -model_part-K)")
    args = parser.parse_args(argv)
    if args.size < 1:
        raise TsConfigError(f"--size {args.size} must be at least 1")
    if not args.input.endswith(".pt") or not args.output.endswith(".pt"):
        raise TsConfigError("--input and --output are checkpoint names ending in .pt")
    paths = part_paths(args.input)
    states = [torch.load(p, map_location="cpu", weights_only=True) for p in paths]
    new_states = reshard_states(states, args.size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    for state, path in zip(new_states, output_paths(args.output, args.size)):
        torch.save(state, path)
        print(f"wrote {path}")
    kept = all("last_optimizer_state" in s for s in new_states)
    note = "optimizer state resharded" if kept else "optimizer state dropped: continue training with --reset-optimizer"
    print(f"resharded {len(paths)} -> {args.size} part(s); {note}", file=sys.stderr)


if __name__ == "__main__":
    main()
