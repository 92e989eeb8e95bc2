"""Checks of a checkpoint against the model it is loaded into, before any weight moves."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from torchscale_fairseq.checkpoints.layout import layer_indices
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import is_expert, sharded_dim


def check_state_dict_shapes(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """One-line error for the common mismatches: dictionary size, model size, and experts split
    over the tensor-parallel ranks where the model has them whole (or the reverse)."""
    own = model.state_dict()
    check_layers(own, state_dict)
    params = dict(model.named_parameters())
    tensor_parallel = any(sharded_dim(p) is not None for p in params.values())
    for name, tensor in state_dict.items():
        if name not in own or not isinstance(tensor, torch.Tensor) or own[name].shape == tensor.shape:
            continue
        if "embed_tokens" in name or "output_projection" in name:
            raise TsConfigError(
                f"the checkpoint's dictionary has {tensor.shape[0]} entries but the data dictionary gives "
                f"{own[name].shape[0]} ({name}): use the dict.txt the checkpoint was trained with"
            )
        if _expert_split_mismatch(name, own[name], tensor, params, tensor_parallel):
            saved, wanted = ("replicate", "split") if sharded_dim(params[name]) is not None else ("split", "replicate")
            raise TsConfigError(
                f"checkpoint expert tensor {name} has shape {tuple(tensor.shape)} but the model expects "
                f"{tuple(own[name].shape)}: the checkpoint's experts were saved with --moe-expert-tensor-parallel "
                f"{saved} and this model uses {wanted}: use --moe-expert-tensor-parallel {saved} (to evaluate: "
                f"--model-overrides \"{{'moe_expert_tensor_parallel': '{saved}'}}\")"
            )
        raise TsConfigError(
            f"checkpoint parameter {name} has shape {tuple(tensor.shape)} but the model expects "
            f"{tuple(own[name].shape)}: use the same --arch and model flags as the checkpoint "
            "(or the resharding tool if it was saved at another --model-parallel-size)"
        )


def check_layers(own: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> None:
    """One line when the checkpoint holds other layers than the model (a pipeline stage: its
    own layers, by global index): another ``--decoder-layers`` or another pipeline split."""
    held, saved = layer_indices(own), layer_indices(state_dict)
    for prefix in sorted(held.keys() | saved.keys()):
        if held.get(prefix, []) != saved.get(prefix, []):
            raise TsConfigError(
                f"the checkpoint holds {prefix}{_ranges(saved.get(prefix, []))} but this model (pipeline stage) holds "
                f"{prefix}{_ranges(held.get(prefix, []))}: use the checkpoint's number of layers and pipeline split "
                "(--pipeline-model-parallel-size, --virtual-pipeline-stages, --pipeline-layers), or convert it "
                "with `ts-reshard --pipeline-size`"
            )


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"{0-2,5}"``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "{" + ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs) + "}"


def _expert_split_mismatch(name: str, own: torch.Tensor, saved: torch.Tensor, params: dict, tensor_parallel: bool) -> bool:
    """An expert tensor of a tensor-parallel model that differs from the checkpoint's only by
    an integer factor along one dimension: whole where split, or split where whole."""
    if not tensor_parallel or name not in params or not is_expert(params[name]) or own.dim() != saved.dim():
        return False
    differ = [(a, b) for a, b in zip(own.shape, saved.shape) if a != b]
    return len(differ) == 1 and max(differ[0]) % min(differ[0]) == 0 and min(differ[0]) > 0
