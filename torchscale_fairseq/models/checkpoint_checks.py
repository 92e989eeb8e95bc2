"""Checks of a checkpoint against the model it is loaded into, before any weight moves."""

from __future__ import annotations

from typing import Mapping

import torch

from torchscale_fairseq.errors import TsConfigError


def check_state_dict_shapes(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """One-line error for the common mismatches: dictionary size and model size."""
    own = model.state_dict()
    for name, tensor in state_dict.items():
        if name not in own or not isinstance(tensor, torch.Tensor) or own[name].shape == tensor.shape:
            continue
        if "embed_tokens" in name or "output_projection" in name:
            raise TsConfigError(
                f"the checkpoint's dictionary has {tensor.shape[0]} entries but the data dictionary gives "
                f"{own[name].shape[0]} ({name}): use the dict.txt the checkpoint was trained with"
            )
        raise TsConfigError(
            f"checkpoint parameter {name} has shape {tuple(tensor.shape)} but the model expects "
            f"{tuple(own[name].shape)}: use the same --arch and model flags as the checkpoint "
            "(or the resharding tool if it was saved at another --model-parallel-size)"
        )
