"""The run's process groups in one object, built once at the edge and handed down.

Rank order (Megatron-core's default): with ``W`` ranks, tensor-parallel size ``T``, pipeline
size ``P`` and data-parallel size ``D = W / (T P)``, the rank at tensor position ``t``,
data-parallel position ``d`` and pipeline stage ``p`` is

    global rank = t + T * (d + D * p)            (tensor fastest, then data, then pipeline)

so a tensor-parallel group is ``T`` consecutive ranks, a data-parallel group the ranks ``T``
apart inside one stage, a pipeline group the ranks ``T D`` apart; the embedding group of a
pipeline joins its first and last stage (``P > 1``; at ``P = 1`` it is the rank itself). At
``P = 1`` this is Megatron-LM appendix B.1. Experts are spread over the data-parallel groups
(:mod:`.expert_parallel`), their groups created here too.

:func:`build_parallel_context` creates every group (``dist.new_group`` is collective over the
world: every rank calls it with the same arguments, in the same order); the edge
(:mod:`torchscale_fairseq.integration.tensor_parallel_init`) keeps the result as the current
context (:func:`set_parallel_context`, :func:`current_parallel_context`,
:func:`destroy_parallel_context`); the model gets it in its
:class:`~torchscale_fairseq.architecture.config.StackConfig` and collectives get their group as
an argument. A group of one is ``None``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.expert_parallel import ExpertParallel, all_local, build_expert_parallel


@dataclass(frozen=True)
class GroupsLayout:
    """The rank lists of every tensor-, data-, pipeline-parallel and embedding group."""

    tensor: list[list[int]]
    data: list[list[int]]
    pipeline: list[list[int]]
    embedding: list[list[int]]


def parallel_groups_layout(world_size: int, tensor_size: int, pipeline_size: int = 1) -> GroupsLayout:
    """Every group's ranks for ``global rank = t + T (d + D p)`` (module docstring)."""
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
    t_size, p_size = tensor_size, pipeline_size
    d_size = world_size // (t_size * p_size)

    def rank(t: int, d: int, p: int) -> int:
        return t + t_size * (d + d_size * p)

    tensor = [[rank(t, d, p) for t in range(t_size)] for p in range(p_size) for d in range(d_size)]
    data = [[rank(t, d, p) for d in range(d_size)] for p in range(p_size) for t in range(t_size)]
    pipeline = [[rank(t, d, p) for p in range(p_size)] for d in range(d_size) for t in range(t_size)]
    embedding = [[ranks[0], ranks[-1]] if p_size > 1 else ranks for ranks in pipeline]
    return GroupsLayout(tensor, data, pipeline, embedding)


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in every group (``*_ranks``: the global ranks of its group, in group
    order; ``*_group``: the process group, ``None`` for a group of one; ``embedding_ranks`` is
    empty on a middle pipeline stage) and the expert layouts the context was built for, keyed by
    ``(expert count, --moe-expert-parallel-size)``."""

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
    expert_layouts: Mapping[tuple[int, int], ExpertParallel] = field(default_factory=dict)

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

    def expert_parallel(self, num_experts: int, expert_parallel_size: int = 0) -> ExpertParallel:
        """The layout of ``num_experts`` experts; on one data-parallel rank every expert is local
        (no group needed), otherwise it must be one the context was built with."""
        if self.data_size == 1:
            return all_local(num_experts, expert_parallel_size)
        key = (num_experts, expert_parallel_size)
        if key not in self.expert_layouts:
            built = ", ".join(f"{e} experts / size {a}" for e, a in self.expert_layouts) or "none"
            raise TsConfigError(
                f"the model asks for {num_experts} experts at --moe-expert-parallel-size {expert_parallel_size} but "
                f"the parallel context holds only the expert layouts it was built with ({built}): pass the model's "
                "MoE configuration to build_parallel_context"
            )
        return self.expert_layouts[key]


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


def build_parallel_context(tensor_size: int, pipeline_size: int = 1,
                           experts: Iterable[tuple[int, int]] = ()) -> ParallelContext:
    """Create every group of the run after ``init_process_group``; every rank calls it with the same
    arguments. ``experts``: the ``(expert count, --moe-expert-parallel-size)`` pairs the model will
    ask for (:meth:`ParallelContext.expert_parallel`)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = parallel_groups_layout(world, tensor_size, pipeline_size)
    tensor_ranks, tensor_group = _create_groups(layout.tensor, rank)
    data_ranks, data_group = _create_groups(layout.data, rank)
    pipeline_ranks, pipeline_group = _create_groups(layout.pipeline, rank)
    embedding_ranks, embedding_group = _create_groups(layout.embedding, rank)
    expert_layouts = {}
    if len(data_ranks) > 1:
        for num_experts, size in dict.fromkeys((int(e), int(a)) for e, a in experts):
            expert_layouts[num_experts, size] = build_expert_parallel(layout.data, rank, data_group, num_experts, size)
    return ParallelContext(world, rank, tensor_ranks, data_ranks, pipeline_ranks, embedding_ranks, tensor_group,
                           data_group, pipeline_group, embedding_group, expert_layouts)


_CURRENT: ParallelContext | None = None


def set_parallel_context(context: ParallelContext) -> None:
    """Make ``context`` the current one (at the edge, after :func:`build_parallel_context`)."""
    global _CURRENT
    _CURRENT = context


def current_parallel_context() -> ParallelContext:
    """The context set at the edge; the single-process one where none was set and no process group
    of several ranks exists (a process group of several ranks without a context: one-line error)."""
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
