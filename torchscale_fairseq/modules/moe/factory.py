"""Which FFN a layer gets: an :class:`MoELayer` in every ``moe_freq``-th layer of an MoE
stack (paper: every second layer), ``None`` (the dense default) elsewhere. Under tensor
parallelism its experts are split over the stack's ``tp_group`` (``--moe-expert-tensor-parallel
split``, the default) or whole on every tensor-parallel rank (``replicate``); under
``--sequence-parallel`` it gathers the sequence over ``tp_group``, under context parallelism its
routing statistics sum over the context-parallel group (see :class:`MoELayer`). Where
its experts live (the expert-parallel groups) is looked up in the stack's parallel context,
which created them: building a model creates no process group."""

from __future__ import annotations

from typing import Any

from torch import nn

from torchscale_fairseq.modules.moe.layer import MoELayer


def build_ffn(cfg: Any, index: int, tag: str) -> nn.Module | None:
    """``cfg``: a :class:`~torchscale_fairseq.architecture.config.StackConfig`."""
    moe = getattr(cfg, "moe", None)
    if moe is None or not moe.is_moe_layer(index):
        return None
    tp_group = cfg.tp_group if moe.expert_tensor_parallel == "split" else None
    parallel = cfg.parallel.expert_parallel(moe.expert_count, moe.expert_parallel_size)
    context = cfg.parallel.context_group if cfg.parallel.context_size > 1 else None
    return MoELayer(moe, cfg.ffn_spec(), tag=tag, parallel=parallel, tp_group=tp_group,
                    sequence_group=cfg.tp_group if getattr(cfg, "sequence_parallel", False) else None,
                    context_group=context)
