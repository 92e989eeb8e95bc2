"""What a layer stack (the decoder of ``ts_lm``, the encoder of ``ts_mlm``) does as a pipeline
stage: it holds the chunks of its layers that ``cfg.split`` gives this rank (the first stage the
embedding, the last the final LayerNorm and output), runs one chunk per forward on the hidden
states the previous stage sent (the forward's ``pipeline_chunk`` and ``pipeline_input``
arguments), and names its layers in its state dict by their global index, as one process does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn as nn

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.sequence_parallel import is_split
from torchscale_fairseq.model_parallel.attributes import mark_pipeline_tied
from torchscale_fairseq.model_parallel.pipeline_parallel import PipelineSplit, global_layer_key, local_layer_key
from torchscale_fairseq.model_parallel.process_groups import group_size


class PipelineStage(nn.Module):
    """Base of a layer stack under ``cfg.split`` (one chunk, the whole stack, in one process)."""

    def init_stage(self, cfg: StackConfig, build_layer: Callable[[int], nn.Module]) -> nn.ModuleList:
        """This rank's layers. Every layer is built, in order, and only this rank's are kept: each
        parameter gets the value one process gives it (one RNG stream); memory holds one other
        layer at most."""
        self.split = cfg.split
        layers = []
        for i in range(cfg.layers):
            layer = build_layer(i)
            if self.split.holds_layer(i):
                layers.append(layer)
        starts = [0]
        for layer_range in self.split.chunk_layers:
            starts.append(starts[-1] + len(layer_range))
        self._chunk_slices = [slice(a, b) for a, b in zip(starts, starts[1:])]
        if self.split.stages > 1:  # a stage's state dict names its layers as one process does
            self.register_state_dict_post_hook(_global_layer_keys)
            self.register_load_state_dict_pre_hook(_local_layer_keys)
        return nn.ModuleList(layers)

    def hidden_shape(self, tokens: torch.Tensor) -> tuple[int, int, int]:
        """The shape of the hidden states between two stages for the stack's input ``tokens``
        ``(B, T)``: ``(B, T, C)``, or this rank's slice ``(B, ceil(T / t), C)`` under sequence
        parallelism in training (the tokens padded to a multiple of ``t``)."""
        batch, length = tokens.shape
        if is_split(self.cfg, self.training):
            length = -(-length // group_size(self.cfg.tp_group))
        return batch, length, self.cfg.embed_dim

    def chunk_layers(self, chunk: int) -> nn.ModuleList:
        return self.layers[self._chunk_slices[chunk]]


def tied_output_copy(split: PipelineSplit, embed_tokens: nn.Module) -> Optional[nn.Module]:
    """The last stage's copy of the tied input/output embedding ``embed_tokens`` when the first
    stage is on another rank (``None`` otherwise); the two are marked so that their gradients are
    summed over the embedding group (Megatron-LM's) and their values stay equal."""
    if split.stages == 1 or not (split.holds_first_stage or split.holds_last_stage):
        return None
    mark_pipeline_tied(embed_tokens.weight, "original" if split.holds_first_stage else "copy")
    return None if split.holds_first_stage else embed_tokens


def _global_layer_keys(module: PipelineStage, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict hook of a pipeline stage: local layer ``j`` saved as its global index."""
    _rename_keys(state_dict, lambda key: global_layer_key(key, f"{prefix}layers.", module.split.layer_indices))


def _local_layer_keys(module: PipelineStage, state_dict: dict, prefix: str, *unused: Any) -> None:
    """Load hook of a pipeline stage: global layer indices back to local ones (a layer of another
    stage keeps its name; :func:`~torchscale_fairseq.models.checkpoint_checks.check_state_dict_shapes`
    refuses such a checkpoint first)."""
    indices = module.split.layer_indices
    _rename_keys(state_dict, lambda key: local_layer_key(key, f"{prefix}layers.", indices) or key)


def _rename_keys(state_dict: dict, rename: Callable[[str], str]) -> None:
    """Rename every key of ``state_dict`` in place, keeping the order."""
    items = list(state_dict.items())
    state_dict.clear()
    state_dict.update((rename(key), value) for key, value in items)
