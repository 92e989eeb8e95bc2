"""The MoE layer: a drop-in for :class:`FeedForwardNetwork` (``(B, T, C) -> (B, T, C)``).

Non-padding tokens are routed (:mod:`.routers`, :mod:`.gating`), scattered by index into
per-expert buffers ``(E, C, d)``, sent to the ranks holding their experts
(:mod:`.all_to_all`), processed by the batched experts, sent back and combined:
``y_t = sum_a gate_a * expert_{e_a}(x_t)``. Dropped (overflowed) and padding tokens
get a zero output, so the residual carries them. After each forward the layer keeps
``balance_loss`` (a scalar tensor, see :mod:`.balance`) and ``stats`` for the criterion.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.moe.all_to_all import all_gather_int, exchange
from torchscale_fairseq.modules.moe.balance import (
    RoutingStats,
    balance_loss,
    routing_stats,
)
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.experts import BatchedExperts
from torchscale_fairseq.modules.moe.gating import (
    Routing,
    expert_choice_routing,
    top_k_routing,
)
from torchscale_fairseq.modules.moe.groups import ExpertParallel, get_expert_parallel
from torchscale_fairseq.modules.moe.routers import build_router

EXPERT_CHOICE_DECODING = (
    "--moe-router expert_choice needs the whole batch and cannot serve autoregressive "
    "(incremental) decoding: generate with a token-choice router (xmoe or linear)"
)


def check_generation(models: Iterable[nn.Module]) -> None:
    """Raise :class:`TsConfigError` if any of ``models`` routes by expert choice (before decoding)."""
    for model in models:
        if any(isinstance(m, MoELayer) and m.cfg.router == "expert_choice" for m in model.modules()):
            raise TsConfigError(EXPERT_CHOICE_DECODING)


class MoELayer(nn.Module):
    takes_padding_mask = True

    def __init__(
        self,
        cfg: MoEConfig,
        embed_dim: int,
        ffn_dim: int,
        activation: str = "gelu",
        activation_dropout: float = 0.0,
        subln: bool = False,
        gain: float = 1.0,
        layernorm_eps: float = 1e-5,
        tag: str = "",
        parallel: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tag = tag
        self.parallel = parallel or get_expert_parallel(cfg.expert_count)
        self.router = build_router(cfg.router, embed_dim, cfg.expert_count, cfg.router_dim, cfg.gate_noise)
        self.experts = BatchedExperts(
            self.parallel.local_experts, self.parallel.first_expert, embed_dim, ffn_dim, activation,
            activation_dropout, subln, gain, layernorm_eps,
        )
        self.experts.set_groups(self.parallel.group, self.parallel.replica_group)
        self.balance_loss: torch.Tensor | None = None
        self.stats: RoutingStats | None = None

    def route(self, tokens: torch.Tensor, incremental: bool = False) -> tuple[torch.Tensor, Routing]:
        """Router probabilities (fp32) and the routing plan of ``tokens`` (N, C)."""
        probs = torch.softmax(self.router(tokens), dim=-1)
        cfg = self.cfg
        factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        if cfg.router == "expert_choice":
            if incremental:
                raise TsConfigError(EXPERT_CHOICE_DECODING)
            return probs, expert_choice_routing(probs, cfg.top_k, factor if factor > 0 else cfg.capacity_factor)
        return probs, top_k_routing(probs, cfg.top_k, factor, cfg.second_expert_policy,
                                    cfg.normalize_gate_prob_before_dropping, self.training)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                incremental: bool = False) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        keep = None
        if padding_mask is not None and bool(padding_mask.any()):
            keep = (~padding_mask.reshape(-1)).nonzero().squeeze(1)
            tokens = flat.index_select(0, keep)
        else:
            tokens = flat
        probs, routing = self.route(tokens, incremental)
        if self.cfg.router == "expert_choice":
            self.balance_loss = probs.new_zeros(()) + 0.0 * probs.sum()
        else:
            self.balance_loss = balance_loss(probs, routing.first_expert, self.parallel.data_parallel_group)
        self.stats = routing_stats(probs, routing.requested, routing.routed, routing.dropped)
        out = self.dispatch_combine(tokens, routing)
        if keep is not None:
            out = flat.new_zeros(flat.shape).index_copy(0, keep, out)
        return out.view(shape)

    def dispatch_combine(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Scatter to ``(E, C, d)`` by index, run the experts, gather and weight."""
        num_experts, dim = self.cfg.expert_count, tokens.size(-1)
        capacity = int(routing.slot.max()) + 1 if routing.slot.numel() > 0 else 0
        index = routing.expert * capacity + routing.slot
        routed = tokens.index_select(0, routing.token)
        buffer = tokens.new_zeros(num_experts * capacity, dim).index_copy(0, index, routed)
        out = self.run_experts(buffer.view(num_experts, capacity, dim))
        weighted = out.reshape(-1, dim).index_select(0, index) * routing.gate.to(out.dtype).unsqueeze(1)
        return tokens.new_zeros(tokens.shape).index_add(0, routing.token, weighted)

    def run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
        """``(E, C, d)`` through the experts, wherever they live."""
        par = self.parallel
        if par.group is None:
            return self.experts(buffer)
        num_local, capacity, dim = par.local_experts, buffer.size(1), buffer.size(2)
        caps = all_gather_int(capacity, par.group, buffer.device)
        send = [num_local * capacity * dim] * par.world
        recv = [num_local * c * dim for c in caps]
        arrived = exchange(buffer, send, recv, par.group).split(recv)
        grouped = torch.cat([a.view(num_local, c, dim) for a, c in zip(arrived, caps)], dim=1)
        processed = self.experts(grouped).split(caps, dim=1)
        back = exchange(torch.cat([p.reshape(-1) for p in processed]), recv, send, par.group)
        return back.view(par.world * num_local, capacity, dim)
