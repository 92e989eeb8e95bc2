"""What a layer stack (the decoder of ``ts_lm``, the encoder of ``ts_mlm``) does as a pipeline
stage: it holds the chunks of its layers that ``cfg.split`` gives this rank (the first stage the
embedding, the last the final LayerNorm and output), runs one chunk per forward on the hidden
states the previous stage sent (the forward's ``pipeline_chunk`` and ``pipeline_input``
arguments). Its layers live in an ``nn.ModuleDict`` keyed by their global index (TorchTitan's), so
every parameter is named as in one process and a stage's parameters are one process's, in its
order, restricted to the stage (the last stage's copy of a tied embedding, registered last, added)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn as nn

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.sequence_parallel import is_split
from torchscale_fairseq.model_parallel.attributes import mark_pipeline_tied
from torchscale_fairseq.model_parallel.pipeline_parallel import PipelineSplit
from torchscale_fairseq.model_parallel.process_groups import group_size

logger = logging.getLogger(__name__)

TIED_COPY = "tied_output"  # the attribute holding the last stage's copy of a tied embedding
EMBEDDING = "embed.embed_tokens.weight"  # a stack's input embedding (the first stage's)


class PipelineStage(nn.Module):
    """Base of a layer stack under ``cfg.split`` (one chunk, the whole stack, in one process)."""

    def init_stage(self, cfg: StackConfig, build_layer: Callable[[int], nn.Module]) -> nn.ModuleDict:
        """This rank's layers, keyed by their global index. Every layer is built, in order, and only
        this rank's are kept: each parameter gets the value one process gives it (one RNG stream);
        memory holds one other layer at most."""
        self.split = cfg.split
        self.attention_kernel_logged = False
        layers = nn.ModuleDict()
        for i in range(cfg.layers):
            layer = build_layer(i)
            if self.split.holds_layer(i):
                layers[str(i)] = layer
        return layers

    def hidden_shape(self, tokens: torch.Tensor) -> tuple[int, int, int]:
        """The shape of the hidden states between two stages for the stack's input ``tokens``
        ``(B, T)``: ``(B, T, E)``; under context parallelism (size ``C``) this rank's two chunks,
        ``(B, T' / C, E)`` with ``T'`` the length padded to the ``2 C`` chunks
        (:attr:`~torchscale_fairseq.architecture.config.StackConfig.sequence_multiple`); of that,
        this rank's slice ``(B, ceil(. / t), E)`` under sequence parallelism in training (the
        tokens padded to a multiple of ``t``)."""
        batch, length = tokens.shape
        context_size = self.cfg.parallel.context_size
        if context_size > 1:
            multiple = self.cfg.sequence_multiple
            length = -(-length // multiple) * multiple // context_size
        if is_split(self.cfg, self.training):
            length = -(-length // group_size(self.cfg.tp_group))
        return batch, length, self.cfg.embed_dim

    def log_attention_kernel(self, layers: list[nn.Module], x: torch.Tensor, causal: bool) -> None:
        """At the stack's first forward, one log line naming the SDPA kernel its self-attention runs
        (``MultiheadAttention.kernel_choice`` of ``layers[0]`` on ``x``)."""
        if self.attention_kernel_logged or not layers:
            return
        self.attention_kernel_logged = True
        logger.info("attention kernel of %s on %s %s: %s", type(self).__name__, x.device.type,
                    str(x.dtype).removeprefix("torch."), layers[0].self_attn.kernel_choice(x, causal))

    def chunk_layers(self, chunk: int) -> list[nn.Module]:
        """The layers of this rank's chunk ``chunk``, in order."""
        return [self.layers[str(i)] for i in self.split.chunk_layers[chunk]]


def register_tied_output(owner: nn.Module, split: PipelineSplit, embed_tokens: nn.Module) -> None:
    """``owner.tied_output``: the last stage's copy of the tied input/output embedding
    ``embed_tokens`` when the first stage is on another rank, ``None`` otherwise (registered either
    way: :func:`pipeline_names` finds where a stage keeps the copy); the two are marked so that their
    gradients are summed over the embedding group (Megatron-LM's) and their values stay equal."""
    copy = None
    if split.stages > 1 and (split.holds_first_stage or split.holds_last_stage):
        mark_pipeline_tied(embed_tokens.weight, "original" if split.holds_first_stage else "copy")
        copy = None if split.holds_first_stage else embed_tokens
    owner.register_module(TIED_COPY, copy)


def pipeline_names(model: nn.Module, stack: nn.Module) -> tuple[str, Optional[tuple[str, str]]]:
    """``(prefix, tied)`` of the layer stack ``stack`` of ``model``: the stack's prefix in ``model``'s
    parameter names (``"decoder."``) and, with a tied embedding, ``(copy, original)``: the name of
    the last stage's copy (:func:`register_tied_output`) and of the embedding it copies."""
    paths = {id(module): name for name, module in model.named_modules()}
    prefix = f"{paths[id(stack)]}." if paths[id(stack)] else ""
    owners = [name for name, module in model.named_modules() if TIED_COPY in module._modules]
    tied = None
    if owners:
        owner = f"{owners[0]}." if owners[0] else ""
        tied = (f"{owner}{TIED_COPY}.weight", f"{prefix}{EMBEDDING}")
    return prefix, tied
