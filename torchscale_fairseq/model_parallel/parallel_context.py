"""The run's process groups in one object, built once at the edge and handed down.

Rank order (Megatron-core's default ``tp-cp-dp-pp``): with ``W`` ranks, tensor-parallel size
``T``, context-parallel size ``C``, pipeline size ``P`` and data-parallel size ``D = W / (T C P)``,
the rank at tensor position ``t``, context position ``c``, data-parallel position ``d`` and
pipeline stage ``p`` is

    global rank = t + T * (c + C * (d + D * p))  (tensor fastest, then context, data, pipeline)

so a tensor-parallel group is ``T`` consecutive ranks, a context-parallel group the ranks ``T``
apart, a data-parallel group the ranks ``T C`` apart inside one stage, a pipeline group the ranks
``T C D`` apart; the embedding group of a pipeline joins its first and last stage (``P > 1``; at
``P = 1`` it is the rank itself). The data-context group (every ``(c, d)`` of one ``(t, p)``,
``C D`` ranks) is where gradients are averaged: the ranks of a context-parallel group read the
same batch but hold different tokens of it. At ``C = P = 1`` this is Megatron-LM appendix B.1.
Experts are spread over the data-context groups (:mod:`.expert_parallel`; Megatron-core's expert
layout spans data x context parallelism too: each rank of a context-parallel group routes its own
tokens), their groups created here as well.

:func:`build_parallel_context` creates every group (``dist.new_group`` is collective over the
world: every rank calls it with the same arguments, in the same order), the expert groups for
the expert-parallel sizes asked for (every divisor of ``C D`` unless given): they depend on the size
alone, so the edge needs no MoE flag but ``--moe-expert-parallel-size``.

Where the context reaches the code: the edge
(:mod:`torchscale_fairseq.integration.tensor_parallel_init`) hands it over through
:func:`set_parallel_context`; fairseq's factories read it once with
:func:`current_parallel_context` (the model's ``build_model`` into its
:class:`~torchscale_fairseq.architecture.config.StackConfig`, the criterion's ``build_criterion``,
the streaming task's construction, the trainer's ``__init__``) and keep it; everything later gets
it, or its groups, as an argument (the trainer gives it to the optimizer's gradient norm). No step
reads the module global. A group of one is ``None``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.expert_parallel import (
    ExpertGroups,
    ExpertParallel,
    build_expert_groups,
    expert_layout,
)


@dataclass(frozen=True)
class GroupsLayout:
    """The rank lists of every tensor-, data-, pipeline-parallel, embedding, context-parallel and
    data-context group."""

    tensor: list[list[int]]
    data: list[list[int]]
    pipeline: list[list[int]]
    embedding: list[list[int]]
    context: list[list[int]]
    data_context: list[list[int]]


def parallel_groups_layout(world_size: int, tensor_size: int, pipeline_size: int = 1,
                           context_size: int = 1) -> GroupsLayout:
    """Every group's ranks for ``global rank = t + T (c + C (d + D p))`` (module docstring)."""
    if tensor_size < 1 or world_size % tensor_size != 0:
        raise TsConfigError(
            f"--model-parallel-size {tensor_size} does not divide the world size {world_size}: "
            "use a model-parallel size that divides --distributed-world-size"
        )
    if pipeline_size < 1 or (world_size // tensor_size) % pipeline_size != 0:
        raise TsConfigError(
            f"pipeline-parallel size {pipeline_size} does not divide the {world_size // tensor_size} rank(s) per "
            f"tensor-parallel position (world size {world_size}, --model-parallel-size {tensor_size}): use a "
            "pipeline size that divides them"
        )
    if context_size < 1 or (world_size // (tensor_size * pipeline_size)) % context_size != 0:
        raise TsConfigError(
            f"--context-parallel-size {context_size} does not divide the {world_size // (tensor_size * pipeline_size)} "
            f"rank(s) per tensor-parallel position and pipeline stage (world size {world_size}): use a context-parallel "
            "size that divides them"
        )
    t_size, p_size, c_size = tensor_size, pipeline_size, context_size
    d_size = world_size // (t_size * p_size * c_size)

    def rank(t: int, d: int, p: int, c: int = 0) -> int:
        return t + t_size * (c + c_size * (d + d_size * p))

    cells = [(c, d) for d in range(d_size) for c in range(c_size)]
    tensor = [[rank(t, d, p, c) for t in range(t_size)] for p in range(p_size) for c, d in cells]
    data = [[rank(t, d, p, c) for d in range(d_size)] for p in range(p_size) for c in range(c_size)
            for t in range(t_size)]
    pipeline = [[rank(t, d, p, c) for p in range(p_size)] for c, d in cells for t in range(t_size)]
    embedding = [[ranks[0], ranks[-1]] if p_size > 1 else ranks for ranks in pipeline]
    context = [[rank(t, d, p, c) for c in range(c_size)] for p in range(p_size) for d in range(d_size)
               for t in range(t_size)]
    data_context = [[rank(t, d, p, c) for c, d in cells] for p in range(p_size) for t in range(t_size)]
    return GroupsLayout(tensor, data, pipeline, embedding, context, data_context)


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in every group (``*_ranks``: the global ranks of its group, in group
    order; ``*_group``: the process group, ``None`` for a group of one; ``embedding_ranks`` is
    empty on a middle pipeline stage; ``context_*``: the context-parallel group, ``data_context_*``
    the data-parallel x context-parallel group gradients are averaged over) and the expert groups
    the context was built with, keyed by their all-to-all size ``A`` (an expert parameter's tag,
    :func:`~torchscale_fairseq.model_parallel.attributes.expert_parallel_size`)."""

    world_size: int
    rank: int
    tensor_ranks: tuple[int, ...]
    data_ranks: tuple[int, ...]
    pipeline_ranks: tuple[int, ...]
    embedding_ranks: tuple[int, ...]
    tensor_group: dist.ProcessGroup | None = None
    data_group: dist.ProcessGroup | None = None
    pipeline_group: dist.ProcessGroup | None = None
    embedding_group: dist.ProcessGroup | None = None
    expert_groups: Mapping[int, ExpertGroups] = field(default_factory=dict)
    context_ranks: tuple[int, ...] = ()
    data_context_ranks: tuple[int, ...] = ()
    context_group: dist.ProcessGroup | None = None
    data_context_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        """Without context parallelism (the ranks left out): a context group of this rank alone,
        and the data-context group is the data-parallel group."""
        if not self.context_ranks:
            object.__setattr__(self, "context_ranks", (self.rank,))
        if not self.data_context_ranks:
            object.__setattr__(self, "data_context_ranks", self.data_ranks)
            object.__setattr__(self, "data_context_group", self.data_group)

    @classmethod
    def single_process(cls) -> ParallelContext:
        """One rank: every size 1, every group ``None``."""
        return cls(1, 0, (0,), (0,), (0,), (0,))

    def __deepcopy__(self, memo: dict) -> ParallelContext:
        """Shared, not copied (a model copy keeps its groups)."""
        return self

    @property
    def tensor_size(self) -> int:
        return len(self.tensor_ranks)

    @property
    def tensor_rank(self) -> int:
        return self.tensor_ranks.index(self.rank)

    @property
    def data_size(self) -> int:
        return len(self.data_ranks)

    @property
    def data_rank(self) -> int:
        return self.data_ranks.index(self.rank)

    @property
    def context_size(self) -> int:
        return len(self.context_ranks)

    @property
    def context_rank(self) -> int:
        return self.context_ranks.index(self.rank)

    @property
    def data_context_size(self) -> int:
        """Ranks the gradients are averaged over: data-parallel x context-parallel."""
        return len(self.data_context_ranks)

    @property
    def data_context_rank(self) -> int:
        return self.data_context_ranks.index(self.rank)

    @property
    def pipeline_size(self) -> int:
        return len(self.pipeline_ranks)

    @property
    def pipeline_rank(self) -> int:
        return self.pipeline_ranks.index(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_rank == self.pipeline_size - 1

    def expert_groups_of(self, size: int) -> ExpertGroups:
        """The expert groups of all-to-all size ``size`` (inside the data-context group); on one
        data-context rank size 1 (every expert local, no group), otherwise groups the context was built with."""
        if self.data_context_size == 1 and size == 1:
            return ExpertGroups()
        if size not in self.expert_groups:
            built = ", ".join(str(a) for a in sorted(self.expert_groups)) or "none"
            raise TsConfigError(
                f"the parallel context holds no expert-parallel groups of size {size} (built: {built}): build it "
                f"with build_parallel_context(..., expert_parallel_sizes) including {size} (fairseq's distributed_init "
                "builds --moe-expert-parallel-size, or every divisor of the data x context-parallel size when it is 0)"
            )
        return self.expert_groups[size]

    def expert_parallel(self, num_experts: int, expert_parallel_size: int = 0) -> ExpertParallel:
        """Where ``num_experts`` experts live at ``--moe-expert-parallel-size`` ``expert_parallel_size``
        (0: the default size, :func:`~torchscale_fairseq.model_parallel.expert_parallel.expert_layout`)."""
        size, _ = expert_layout(self.data_context_size, num_experts, expert_parallel_size)
        return self.expert_groups_of(size).place(num_experts)


def _create_groups(layout: list[list[int]], rank: int) -> tuple[tuple[int, ...], dist.ProcessGroup | None]:
    """``new_group`` for every rank list of ``layout`` longer than one (on every rank, in order);
    this rank's ranks and group (``()``, ``None`` when it is in none)."""
    mine: tuple[int, ...] = ()
    group = None
    for ranks in layout:
        created = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine, group = tuple(ranks), created
    return mine, group


def divisors(n: int) -> list[int]:
    """Every ``a`` in ``1 ... n`` that divides ``n``."""
    return [a for a in range(1, n + 1) if n % a == 0]


def build_parallel_context(tensor_size: int, pipeline_size: int = 1,
                           expert_parallel_sizes: Iterable[int] | None = None,
                           context_size: int = 1) -> ParallelContext:
    """Create every group of the run after ``init_process_group``; every rank calls it with the same
    arguments. ``expert_parallel_sizes``: the all-to-all sizes ``A`` the model may ask for
    (``None``: every divisor of the data-context size ``C D``; none on one data-context rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = parallel_groups_layout(world, tensor_size, pipeline_size, context_size)
    tensor_ranks, tensor_group = _create_groups(layout.tensor, rank)
    data_ranks, data_group = _create_groups(layout.data, rank)
    pipeline_ranks, pipeline_group = _create_groups(layout.pipeline, rank)
    embedding_ranks, embedding_group = _create_groups(layout.embedding, rank)
    context_ranks, context_group = _create_groups(layout.context, rank)
    data_context_ranks, data_context_group = (_create_groups(layout.data_context, rank) if context_size > 1
                                              else (data_ranks, data_group))
    experts_size = len(data_context_ranks)
    sizes = divisors(experts_size) if expert_parallel_sizes is None else expert_parallel_sizes
    expert_groups = {}
    if experts_size > 1:
        for size in dict.fromkeys(int(a) for a in sizes):
            expert_groups[size] = build_expert_groups(layout.data_context, rank, data_context_group, size)
    return ParallelContext(world, rank, tensor_ranks, data_ranks, pipeline_ranks, embedding_ranks, tensor_group,
                           data_group, pipeline_group, embedding_group, expert_groups, context_ranks,
                           data_context_ranks, context_group, data_context_group)


_CURRENT: ParallelContext | None = None


def set_parallel_context(context: ParallelContext) -> None:
    """Hand ``context`` to fairseq's factories (at the edge, after :func:`build_parallel_context`)."""
    global _CURRENT
    _CURRENT = context


def current_parallel_context() -> ParallelContext:
    """The context set at the edge, for a factory to keep (never read on the step path); the
    single-process one where none was set and no process group of several ranks exists (a process
    group of several ranks without a context: one-line error)."""
    if _CURRENT is not None:
        return _CURRENT
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise TsConfigError(
            f"torch.distributed runs {dist.get_world_size()} ranks but no parallel context was set: call "
            "set_parallel_context(build_parallel_context(...)) on every rank after init_process_group "
            "(fairseq's distributed_init does, with this plugin)"
        )
    return ParallelContext.single_process()


def destroy_parallel_context() -> None:
    """Forget the current context (Megatron-LM's ``destroy_model_parallel``), so that no module
    global keeps a process group alive past ``dist.destroy_process_group``."""
    global _CURRENT
    _CURRENT = None
