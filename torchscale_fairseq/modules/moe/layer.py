"""The MoE layer: a drop-in for :class:`FeedForwardNetwork` (``(B, T, C) -> (B, T, C)``).

Non-padding tokens are routed (:mod:`.routers`, :mod:`.gating`), gathered by index into
rows grouped by expert (no ``(E, C, d)`` capacity padding), sent to the ranks holding
their experts (:mod:`.all_to_all`), processed by the grouped experts, sent back and combined:
``y_t = sum_a gate_a * expert_{e_a}(x_t)`` (plus the shared experts' FFN of ``x_t``). Dropped
(overflowed) and padding tokens get a zero routed output, so the residual carries them.

At expert-parallel size 1 the forward reads nothing on the host (a GPU stream never waits,
``torch.compile`` sees no data-dependent shape): the routing plan has a fixed shape (every
candidate assignment, with a kept mask), counts are ``index_add`` sums, the statistics stay
tensors until the criterion reads them once per step, and the rows after the kept ones reach
no expert; only experts that run one GEMM per expert read their row counts (one read per layer,
none with grouped GEMMs). With expert parallelism the all-to-all's split sizes are the one read.

The forward returns the output and an :class:`~.balance.MoEAux` (balance loss, router z-loss
and routing statistics, see :mod:`.balance`), which the model passes up to the criterion for
its logs. In training the output carries the auxiliary losses' gradients
(:class:`~.aux_loss.MoEAuxLossAutoScaler`) with the :class:`~.aux_loss.AuxLossScale` set on the
layer (``aux_loss_scale``) when it runs forward.

Under activation checkpointing the layer's forward runs twice, the second time in backward
with the random generators replayed (so the router draws the same noise and second
experts: the draws are repeated, not skipped, so that the dropout after them draws the same
masks). A :class:`RecomputeMemo` handed to both runs keeps what the first learned from
other ranks (the all-to-all count table, the global balance-loss counts) and its routing
statistics, and the recomputation checks that it routed as the first run did. The outputs
of the two all-to-alls (the experts' inputs, saved by the experts for their weight
gradients; the experts' outputs back home, saved for the gate gradient) are needed in
backward: ``--moe-checkpoint-exchange repeat`` (default, as Megatron-core) sends the two
all-to-alls again in the recomputation; ``keep`` keeps their outputs from the forward pass
(``2 k N d`` more activations per MoE layer for ``N`` tokens of width ``d``) and the
recomputation sends nothing.

Under sequence parallelism (``sequence_group``: the tensor-parallel group the stack splits
the sequence over, in training) the layer receives this rank's ``(B, T/t, C)`` slice. It
all-gathers the ``t`` slices at its entry and runs on the whole ``(B, T, C)`` exactly as
under plain tensor parallelism (router replicated on the same tokens, so routing,
capacity and the balance loss are those of TP = 1; the padding mask is the stack's
full-length one, so the tokens padded to a multiple of ``t`` are not routed), then keeps
this rank's slice of the output. The entry is Megatron's
``gather_from_sequence_parallel_region`` (all-gather forward, split backward) and the exit
``scatter_to_sequence_parallel_region`` (split forward, all-gather backward): inside, every
gradient is whole and the same on every rank as under plain tensor parallelism (the
router's and the experts' included, so none is sequence-parallel-marked), and the gradient
leaving the entry is this rank's slice of it. The bytes match Megatron-core's all-gather
dispatcher (an all-gather each way, ``B T C`` elements).

Under context parallelism (``context_group``: the ranks holding the other chunks of this rank's
sequences) each rank routes its own tokens; the routing statistics are summed over the group
(:func:`~.balance.micro_batch_totals`), so that the balance loss, the z-loss and the load CV
add up to those of ``C = 1``, and the experts are spread over the data-parallel x
context-parallel ranks (the expert layout of the run's context). The capacity
``ceil(f T k / E)`` counts this rank's tokens ``T`` (as Megatron-core's): with dropping
(``--moe-capacity-factor > 0`` and full experts) the kept assignments differ from ``C = 1``;
without it, and with a deterministic second expert (``--moe-second-expert-policy all``, or
top-1, or top-k > 2), routing is that of ``C = 1`` token by token.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.expert_parallel import ExpertParallel
from torchscale_fairseq.model_parallel.layers import TensorParallelGroup
from torchscale_fairseq.model_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from torchscale_fairseq.model_parallel.process_groups import group_size
from torchscale_fairseq.modules.feedforward import FeedForwardNetwork, FFNSpec
from torchscale_fairseq.modules.moe.all_to_all import all_gather_counts, exchange
from torchscale_fairseq.modules.moe.aux_loss import AuxLossScale, MoEAuxLossAutoScaler
from torchscale_fairseq.modules.moe.balance import (
    MoEAux,
    RoutingStats,
    balance_loss,
    choice_totals,
    micro_batch_totals,
    router_z_loss,
    routing_stats,
)
from torchscale_fairseq.modules.moe.capacity import by_expert, expert_counts
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.experts import GroupedExperts
from torchscale_fairseq.modules.moe.gating import (
    DispatchPlan,
    Routing,
    dispatch_plan,
    expert_choice_routing,
    top_k_routing,
)
from torchscale_fairseq.modules.moe.routers import build_router

logger = logging.getLogger(__name__)

EXPERT_CHOICE_DECODING = (
    "--moe-router expert_choice needs the whole batch and cannot serve autoregressive "
    "(incremental) decoding: generate with a token-choice router (xmoe, linear or torchscale_xmoe)"
)


# The backend of the compiled routing and experts, and the cache entries of each: training and validation, with
# and without padding, the fused dispatch or not, static then dynamic token counts (more than dynamo's default 8).
COMPILE_BACKEND = "inductor"
COMPILED_ENTRIES = 32
# Inductor's options for them: combo kernels (horizontal fusion) launch independent kernels of a graph as one,
# as the routing's many small ones are; outside --ts-compile an MoE layer's step is bound by its launches.
INDUCTOR_OPTIONS = {"combo_kernels": True}
_EAGER_COMBINE_LOGGED: set[str] = set()  # why --moe-compiled-experts ran eagerly, logged once each


def _compiled(fn: Callable, backend: str | Callable) -> Callable:
    """``torch.compile(fn)`` with room for :data:`COMPILED_ENTRIES` cache entries; inductor's with
    :data:`INDUCTOR_OPTIONS`."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_ENTRIES)
    return torch.compile(fn, backend=backend, options=INDUCTOR_OPTIONS if backend == "inductor" else None)


@functools.cache
def compiled_routing(backend: str) -> Callable:
    """:meth:`MoELayer._routing` compiled once for all MoE layers (``self`` is an argument): the router, the
    softmax, the top-k, the slots, the gates, the dispatch rows, the losses and the statistics as one graph
    forward and one backward, where eagerly they are about a hundred small kernels each way."""
    return _compiled(MoELayer._routing, backend)


@functools.cache
def compiled_combine(backend: str) -> Callable:
    """:meth:`~.experts.GroupedExperts.combine` compiled once for all MoE layers (the experts are an
    argument): the gather, the grouped GEMMs, their biases, the activation, the Sub-LN and the weighted
    combine as one graph forward and one backward, the GEMMs inside it as ``torch._grouped_mm`` calls and
    the elementwise steps between them fused."""
    return _compiled(GroupedExperts.combine, backend)


def _log_eager_experts(why: str) -> None:
    """One line per reason that ``--moe-compiled-experts on`` left a layer's experts eager."""
    if why not in _EAGER_COMBINE_LOGGED:
        _EAGER_COMBINE_LOGGED.add(why)
        logger.info("--moe-compiled-experts on: the experts run eagerly, as %s", why)


def check_generation(models: Iterable[nn.Module]) -> None:
    """Raise :class:`TsConfigError` if any of ``models`` routes by expert choice (before decoding)."""
    for model in models:
        if any(isinstance(m, MoELayer) and m.cfg.router == "expert_choice" for m in model.modules()):
            raise TsConfigError(EXPERT_CHOICE_DECODING)


def update_expert_biases(model: nn.Module, data_parallel_group: object | None,
                         applied: torch.Tensor | None = None) -> None:
    """Auxiliary-loss-free balancing after an update (DeepSeek-V3, section 2.1.2): each MoE layer's
    ``expert_bias`` moves by ``rate * sign(mean load - load_e)``, ``load_e`` the assignments its
    router asked of expert ``e`` (before capacity dropping) over the update's training tokens of
    every rank in ``data_parallel_group`` (one all-reduce for all layers), so the biases stay equal
    on every rank; the counts start again from zero. ``applied`` (a device 0/1): whether the
    optimizer applied the update (a skipped update moves no bias), known on the device only."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.expert_bias is not None]
    if not layers:
        return
    loads = torch.cat([m.expert_load for m in layers]).float()
    if data_parallel_group is not None and dist.is_initialized() and dist.get_world_size(data_parallel_group) > 1:
        dist.all_reduce(loads, group=data_parallel_group)
    for layer, load in zip(layers, loads.split([m.cfg.expert_count for m in layers])):
        step = layer.cfg.router_bias_update_rate * torch.sign(load.mean() - load)
        layer.expert_bias += step if applied is None else step * applied
    discard_expert_loads(model)


def discard_expert_loads(model: nn.Module) -> None:
    """Forget the loads counted since the last update (a skipped update changes no bias)."""
    for m in model.modules():
        if isinstance(m, MoELayer) and m.expert_load is not None:
            m.expert_load.zero_()


@dataclass
class RecomputeMemo:
    """One checkpointed call of an :class:`MoELayer`: filled by its forward, read by its
    recomputation in backward. ``counts``: rows per expert this rank dispatched; ``table``:
    every rank's counts (the all-gather); ``totals``: the balance loss's
    :func:`~.balance.choice_totals`; ``tokens``: the micro-batch's real tokens (the z-loss's
    ``N``); ``stats``: the routing statistics; ``scale``: the auxiliary
    losses' scale of the forward (another micro-batch's may be set by the recomputation);
    ``exchanged``: the outputs of the two all-to-alls (``--moe-checkpoint-exchange keep``)."""

    counts: torch.Tensor | None = None
    table: torch.Tensor | None = None
    totals: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    stats: RoutingStats | None = None
    scale: AuxLossScale | None = None
    exchanged: tuple[torch.Tensor, torch.Tensor] | None = None
    filled: bool = False


class MoELayer(nn.Module):
    """``parallel``: where the experts live (given by the model builder from
    :meth:`~torchscale_fairseq.model_parallel.parallel_context.ParallelContext.expert_parallel`); ``None``: all local.
    ``tp_group``: the tensor-parallel group every expert is split over (``None``: whole
    experts, replicated on the tensor-parallel ranks); the router is replicated either way.
    ``sequence_group``: the group the input's sequence is split over in training
    (``--sequence-parallel``; ``None``: whole sequences). ``context_group``: the context-parallel
    group (``None``: whole sequences), over which the routing statistics are summed."""

    def __init__(
        self,
        cfg: MoEConfig,
        spec: FFNSpec,
        *,
        tag: str = "",
        parallel: ExpertParallel | None = None,
        tp_group: TensorParallelGroup = None,
        sequence_group: TensorParallelGroup = None,
        context_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``spec``: the stack's dense FFN; each expert is one of width ``cfg.expert_ffn_dim``
        (0: ``spec.ffn_dim``), the shared experts one FFN ``cfg.shared_expert_count`` times as wide."""
        super().__init__()
        self.cfg = cfg
        self.sequence_group = sequence_group
        self.context_group = context_group
        self.tag = tag
        self.parallel = parallel or ExpertParallel(cfg.expert_count, cfg.expert_count, 0)  # all experts local
        self.router = build_router(cfg.router, spec.embed_dim, cfg.expert_count, cfg.router_dim, cfg.gate_noise)
        expert_spec = replace(spec, ffn_dim=cfg.expert_ffn_dim or spec.ffn_dim)
        self.experts = GroupedExperts(expert_spec, num_local=self.parallel.local_experts,
                                      first_expert=self.parallel.first_expert, tp_group=tp_group)
        self.experts.mark_expert_parallel(self.parallel.world)
        self.shared_experts = None
        if cfg.shared_expert_count > 0:
            shared_spec = replace(expert_spec, ffn_dim=cfg.shared_expert_count * expert_spec.ffn_dim)
            self.shared_experts = FeedForwardNetwork(shared_spec, tp_group=tp_group)
        if cfg.router_bias_update_rate > 0:  # fp32 bias, saved in checkpoints; integer counts
            self.register_buffer("expert_bias", torch.zeros(cfg.expert_count))
            self.register_buffer("expert_load", torch.zeros(cfg.expert_count, dtype=torch.long), persistent=False)
        else:
            self.expert_bias = self.expert_load = None
        self.aux_loss_scale: AuxLossScale | None = None  # set per micro-batch (aux_loss.set_aux_loss_scale)
        self.fused_dispatch = True  # False: _combine_stepwise, the fused path's reference
        self.compiled_routing = cfg.compiled_routing == "on"  # --moe-compiled-routing
        self.compiled_experts = cfg.compiled_experts == "on"  # --moe-compiled-experts

    def _apply(self, fn, recurse: bool = True):
        """``model.half()`` / ``bfloat16()`` keep the expert bias in fp32 (Megatron-core does too)."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def route(self, scores: torch.Tensor, incremental: bool = False,
              real: torch.Tensor | None = None) -> tuple[torch.Tensor, Routing]:
        """Router probabilities (fp32) and the routing plan from the router's ``scores`` (N, E)
        of the tokens ``real`` marks (``None``: all)."""
        probs = torch.softmax(scores, dim=-1)
        cfg = self.cfg
        factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        if cfg.router == "expert_choice":
            if incremental:
                raise TsConfigError(EXPERT_CHOICE_DECODING)
            return probs, expert_choice_routing(probs, cfg.top_k, factor if factor > 0 else cfg.capacity_factor, real)
        return probs, top_k_routing(probs, cfg.top_k, factor, cfg.second_expert_policy,
                                    cfg.normalize_gate_prob_before_dropping, self.training, self.expert_bias, real)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                incremental: bool = False, memo: RecomputeMemo | None = None) -> tuple[torch.Tensor, MoEAux]:
        """``memo``: shared by the forward and the recomputation of one checkpointed call
        (see the module docstring); ``None`` without checkpointing."""
        split = self.sequence_group is not None and self.training
        if split:
            x = gather_from_sequence_parallel_region(x, self.sequence_group)
        out, aux = self._forward(x, padding_mask, incremental, memo)
        if not torch.compiler.is_compiling():  # compiled, the transformer layer tags it after the graph
            aux.tag = self.tag
        return (scatter_to_sequence_parallel_region(out, self.sequence_group) if split else out), aux

    def _forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None, incremental: bool,
                 memo: RecomputeMemo | None) -> tuple[torch.Tensor, MoEAux]:
        replay = memo is not None and memo.filled
        if padding_mask is not None and padding_mask.shape != x.shape[:-1]:
            raise ValueError(f"MoE layer {self.tag!r}: padding mask {tuple(padding_mask.shape)} does not cover "
                             f"the tokens {tuple(x.shape[:-1])}")
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        real = None if padding_mask is None else ~padding_mask.reshape(-1)
        why_not_fused = self._why_not_fused(tokens)
        fused = why_not_fused is None
        if self.compiled_experts and not fused and not torch.compiler.is_compiling():
            _log_eager_experts(why_not_fused)
        route = compiled_routing(COMPILE_BACKEND) if self._routes_compiled(incremental, memo) else MoELayer._routing
        routing, loss, z_loss, stats, totals, micro_tokens, plan = route(self, tokens, real, incremental, memo, fused)
        if memo is not None:
            memo.totals, memo.tokens = totals, micro_tokens
        scale = memo.scale if replay else self.aux_loss_scale
        if self.expert_load is not None and self.training and not replay:
            self.expert_load += routing.load.long()
        aux = MoEAux(loss, z_loss, stats, scale)
        if fused:
            out = self._combine_planned(tokens, plan, incremental, memo)
        else:
            out = self._combine_stepwise(tokens, routing, memo)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            out = out + (shared if real is None else shared * real.unsqueeze(1).to(shared.dtype))
        if scale is not None and torch.is_grad_enabled():
            out = MoEAuxLossAutoScaler.apply(out, aux.balance_loss, aux.z_loss, scale.balance, scale.z)
        if memo is not None:
            memo.stats, memo.scale, memo.filled = stats, scale, True
        return out.view(shape), aux

    def _routing(self, tokens: torch.Tensor, real: torch.Tensor | None, incremental: bool,
                 memo: RecomputeMemo | None, fused: bool) -> tuple:
        """Router scores to the routing plan, the balance loss, the router z-loss and the routing statistics
        (a recomputation takes the first run's totals and statistics from ``memo``), and with ``fused`` the
        rows of the fused dispatch (:func:`~.gating.dispatch_plan`): what :func:`compiled_routing` compiles as
        one graph. Returns ``(routing, balance_loss, z_loss, stats, totals, micro_tokens, plan)``."""
        scores = self.router(tokens)
        probs, routing = self.route(scores, incremental, real)
        num_experts = probs.size(1)
        if memo is not None and memo.filled:
            totals, micro_tokens, stats = memo.totals, memo.tokens, memo.stats
        else:  # the micro-batch's (over the context-parallel group), the global scope's over the layout's ranks
            micro = micro_batch_totals(routing.first_expert, routing.load, self.context_group, real)
            global_scope = self.cfg.balance_scope == "global" and self.cfg.router != "expert_choice"
            totals = (choice_totals(routing.first_expert, num_experts, self.parallel.data_parallel_group, real)
                      if global_scope else micro[:num_experts + 1])
            micro_tokens = micro[num_experts] if self.context_group is not None else None
            stats = routing_stats(probs, routing, micro[num_experts + 1:])
        if self.cfg.router == "expert_choice":
            loss = probs.new_zeros(()) + 0.0 * probs.sum()
        else:
            loss = balance_loss(probs, routing.first_expert, totals=totals, real=real)
        plan = dispatch_plan(routing, num_experts) if fused else None
        return routing, loss, router_z_loss(scores, real, micro_tokens), stats, totals, micro_tokens, plan

    def _routes_compiled(self, incremental: bool, memo: RecomputeMemo | None) -> bool:
        """Whether :meth:`_routing` runs compiled: with :attr:`compiled_routing`, outside ``--ts-compile``'s
        graph, in a forward that reads and reduces nothing across ranks, not an activation-checkpointed
        call, not incremental decoding; with a router and a second-expert policy that trace as one graph
        (not TorchScale's gate, which rescales its expert embeddings in place, nor expert choice, whose
        capacity is read on the host, nor the Gumbel draw of ``sampling``)."""
        if not self.compiled_routing or torch.compiler.is_compiling():
            return False
        cfg = self.cfg
        return (not incremental and memo is None and self.context_group is None and cfg.balance_scope == "local"
                and cfg.router in ("xmoe", "linear") and cfg.second_expert_policy != "sampling")

    def _why_not_fused(self, tokens: torch.Tensor) -> str | None:
        """Why the routed tokens cannot take the fused path (:meth:`_combine_planned`: :attr:`fused_dispatch`,
        local whole experts and grouped GEMMs; else :meth:`_combine_stepwise`); ``None`` where they take it."""
        if not self.fused_dispatch:
            return "the stepwise reference path was asked for"
        if self.parallel.group is not None:
            return "expert parallelism sends the rows to other ranks"
        if group_size(self.experts.tp_group) > 1:
            return "the experts are split over the tensor-parallel ranks"
        if not self.experts.runs_grouped(tokens):
            return "the expert GEMMs run one per expert (grouped GEMMs: see experts.grouped_mm_fits)"
        return None

    def _combine_planned(self, tokens: torch.Tensor, plan: DispatchPlan, incremental: bool,
                         memo: RecomputeMemo | None) -> torch.Tensor:
        """The fused path (:attr:`fused_dispatch`, local whole experts, grouped GEMMs): ``plan``'s row order
        (:func:`~.gating.dispatch_plan`: no second sort) and :meth:`~.experts.GroupedExperts.combine` (the
        gather inside fc1, the weighted combine inside fc2), compiled where :meth:`_combines_compiled`."""
        self._check_replay(plan.counts, memo)
        if self.compiled_experts and memo is not None and not torch.compiler.is_compiling():
            _log_eager_experts("the calls are activation-checkpointed")
        combine = compiled_combine(COMPILE_BACKEND) if self._combines_compiled(incremental, memo) else \
            GroupedExperts.combine
        return combine(self.experts, tokens, plan.token, plan.gate, plan.groups)

    def _combines_compiled(self, incremental: bool, memo: RecomputeMemo | None) -> bool:
        """Whether the fused path's combine runs compiled: with :attr:`compiled_experts`, outside
        ``--ts-compile``'s graph, not an activation-checkpointed call (its recomputation must draw the
        first run's dropout masks: checked for the eager kernels only), not incremental decoding (a few
        tokens a step: nothing to fuse that pays for a compilation)."""
        return self.compiled_experts and not torch.compiler.is_compiling() and not incremental and memo is None

    def _combine_stepwise(self, tokens: torch.Tensor, routing: Routing, memo: RecomputeMemo | None) -> torch.Tensor:
        """The steps one by one, the fused path's reference and the path of every other layout (one GEMM per
        expert reads the counts on the host anyway, and breaks a compiled graph there)."""
        num_experts = self.cfg.expert_count
        expert = torch.where(routing.kept, routing.expert, num_experts)
        order = by_expert(expert)
        token = routing.token[order]
        counts = expert_counts(expert, num_experts + 1)[:num_experts]
        # split experts: f of the column-parallel fc1 on the (fewer) tokens rather than the rows
        source = copy_to_tensor_parallel_region(tokens, self.experts.tp_group)
        out = self.run_experts(source.index_select(0, token), counts, memo)
        weighted = out * routing.gate[order].to(out.dtype).unsqueeze(1)
        return tokens.new_zeros(tokens.shape).index_add(0, token, weighted)

    def _check_replay(self, counts: torch.Tensor, memo: RecomputeMemo | None) -> None:
        """In a recomputation, assert (on the device) that the routing gave the first run's counts;
        in a first run, keep them."""
        if memo is None:
            return
        if memo.filled:
            torch._assert_async(
                (counts == memo.counts).all(),
                f"MoE layer {self.tag!r} routed differently when activation checkpointing recomputed it: its routing "
                "must be a function of its input and the replayed random generators")
        else:
            memo.counts = counts

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, memo: RecomputeMemo | None = None) -> torch.Tensor:
        """``rows`` grouped by expert (``counts[e]`` for expert ``e``, then rows for no expert)
        through the experts, wherever they live; the rows for no expert come back zero. Across
        ranks only the experts' rows travel: rank ``r`` sends rank ``q`` the rows of ``q``'s
        experts, receives them grouped by (sender, expert) and regroups them by (expert, sender)
        for the experts; the all-to-all's split sizes are the one host read. With a filled
        ``memo`` (recomputation) the count table is the first run's (and the all-to-all outputs,
        if kept), and the routing must have given the same counts (checked on the device)."""
        par = self.parallel
        if memo is not None and memo.filled:
            self._check_replay(counts, memo)
            table = memo.table
        else:
            table = None if par.group is None else all_gather_counts(counts, par.group)
            if memo is not None:
                memo.counts, memo.table = counts, table
        if par.group is None:
            return self.experts(rows, counts)
        dim = rows.size(1)
        table = table.view(par.world, par.world, par.local_experts)
        splits = table.tolist()  # the split sizes: the one host read
        send_rows = [sum(splits[par.rank][q]) for q in range(par.world)]
        mine = [[splits[s][par.rank][e] for e in range(par.local_experts)] for s in range(par.world)]
        recv_rows = [sum(row) for row in mine]
        sent = sum(send_rows)
        kept = memo.exchanged if memo is not None and memo.filled else None
        if kept is not None:  # the forward's values, a leaf as the exchange's output would require grad
            arrived = kept[0].detach().requires_grad_(rows.requires_grad)
        else:
            arrived = exchange(rows[:sent], [n * dim for n in send_rows], [n * dim for n in recv_rows],
                               par.group).view(-1, dim)
        mine_counts = table[:, par.rank]
        order = sender_to_expert_order(mine_counts)
        per_expert = [sum(mine[s][e] for s in range(par.world)) for e in range(par.local_experts)]
        out = self.experts(arrived.index_select(0, order), per_expert)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        outgoing = out.index_select(0, inverse)  # also recomputed: the same tensors are saved as in forward
        if kept is not None:
            back = kept[1].detach().requires_grad_(outgoing.requires_grad)
        else:
            back = exchange(outgoing, [n * dim for n in recv_rows], [n * dim for n in send_rows],
                            par.group).view(-1, dim)
            if memo is not None and self.cfg.checkpoint_exchange == "keep":
                memo.exchanged = (arrived.detach(), back.detach())
        return torch.cat([back, back.new_zeros(rows.size(0) - sent, dim)])


def sender_to_expert_order(counts: torch.Tensor) -> torch.Tensor:
    """Row order that turns rows grouped by (sender, expert), ``counts[s, e]`` rows each, into
    rows grouped by (expert, sender)."""
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts)
    by_expert = counts.t().reshape(-1)
    first = starts.t().reshape(-1)
    total = int(by_expert.sum())
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        torch.cumsum(by_expert, 0) - by_expert, by_expert, output_size=total)
    return torch.repeat_interleave(first, by_expert, output_size=total) + within
