"""The parallel context: the rank layout of every group against an independent enumeration and
Megatron-core's construction loops (tensor fastest, then data, then pipeline), its one-line
errors, the single-process context, the expert-layout lookup, and on 4 gloo ranks the groups
the building function creates (``T = 2 x P = 2``, ``P = 4``, experts over ``D = 4`` at every
expert-parallel size or one), their members found by an all-reduce inside each group."""

from __future__ import annotations

from pathlib import Path

import pytest
from mp_helpers import run_worker_ranks

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel import parallel_context
from torchscale_fairseq.model_parallel.parallel_context import (
    ParallelContext,
    current_parallel_context,
    destroy_parallel_context,
    parallel_groups_layout,
    set_parallel_context,
)

WORKER = Path(__file__).resolve().parent / "context_worker.py"
SIZES = [(1, 1, 1), (4, 2, 1), (4, 4, 1), (8, 2, 1), (4, 1, 2), (8, 2, 2), (8, 1, 4), (12, 3, 2), (16, 2, 4), (6, 1, 3)]


def enumerated(world: int, t_size: int, p_size: int) -> dict[str, set[tuple[int, ...]]]:
    """Every group as the set of ranks sharing the other coordinates of ``(t, d, p)``, the
    coordinates read off each rank as the mixed-radix digits of ``rank`` (``t`` fastest)."""
    d_size = world // (t_size * p_size)
    coords = {r: (r % t_size, r // t_size % d_size, r // (t_size * d_size)) for r in range(world)}
    out: dict[str, set[tuple[int, ...]]] = {}
    for kind, axis in (("tensor", 0), ("data", 1), ("pipeline", 2)):
        keyed: dict[tuple, list[int]] = {}
        for r, c in coords.items():
            keyed.setdefault(c[:axis] + c[axis + 1:], []).append(r)
        out[kind] = {tuple(sorted(g)) for g in keyed.values()}
    out["embedding"] = {(g[0], g[-1]) if p_size > 1 else g for g in out["pipeline"]}
    return out


def megatron_loops(world: int, t_size: int, p_size: int) -> dict[str, list[list[int]]]:
    """The groups in the order Megatron-LM's ``initialize_model_parallel`` (before
    ``RankGenerator``) creates them."""
    stages = world // p_size
    data = [list(range(p * stages + t, (p + 1) * stages, t_size)) for p in range(p_size) for t in range(t_size)]
    tensor = [list(range(i * t_size, (i + 1) * t_size)) for i in range(world // t_size)]
    pipeline = [list(range(i, world, stages)) for i in range(stages)]
    embedding = [[g[0], g[-1]] if len(g) > 1 else g for g in pipeline]
    return {"tensor": tensor, "data": data, "pipeline": pipeline, "embedding": embedding}


@pytest.mark.parametrize("world,t_size,p_size", SIZES)
def test_layout_equals_enumeration_and_megatron_order(world, t_size, p_size):
    layout = parallel_groups_layout(world, t_size, p_size)
    expected = enumerated(world, t_size, p_size)
    loops = megatron_loops(world, t_size, p_size)
    for kind in ("tensor", "data", "pipeline", "embedding"):
        groups = getattr(layout, kind)
        assert {tuple(g) for g in groups} == expected[kind], kind
        assert groups == loops[kind], kind
    for kind in ("tensor", "data", "pipeline"):  # a partition of the world
        assert sorted(r for g in getattr(layout, kind) for r in g) == list(range(world)), kind


def test_pipeline_size_one_is_consecutive_tensor_groups_strided_data_groups():
    layout = parallel_groups_layout(8, 2)
    assert layout.tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.pipeline == layout.embedding == [[r] for r in range(8)]


@pytest.mark.parametrize("world,t_size,p_size,match", [
    (4, 3, 1, r"^--model-parallel-size 3 does not divide the world size 4: use a model-parallel size that divides"),
    (4, 0, 1, r"^--model-parallel-size 0 does not divide the world size 4"),
    (8, 2, 3, r"^pipeline-parallel size 3 does not divide the 4 rank\(s\) per tensor-parallel position"),
    (4, 1, 0, r"^pipeline-parallel size 0 does not divide"),
])
def test_layout_errors_are_one_line(world, t_size, p_size, match):
    with pytest.raises(TsConfigError, match=match) as e:
        parallel_groups_layout(world, t_size, p_size)
    assert "\n" not in str(e.value)


def test_single_process_context():
    ctx = ParallelContext.single_process()
    assert (ctx.world_size, ctx.rank) == (1, 0)
    assert (ctx.tensor_size, ctx.data_size, ctx.pipeline_size) == (1, 1, 1)
    assert (ctx.tensor_rank, ctx.data_rank, ctx.pipeline_rank) == (0, 0, 0)
    assert ctx.is_first_stage and ctx.is_last_stage
    assert ctx.tensor_group is ctx.data_group is ctx.pipeline_group is ctx.embedding_group is None
    layout = ctx.expert_parallel(8)
    assert (layout.local_experts, layout.first_expert, layout.group) == (8, 0, None)


def test_unbuilt_expert_groups_are_one_line():
    two_data_ranks = ParallelContext(2, 1, (1,), (0, 1), (1,), (1,))
    assert two_data_ranks.data_rank == 1
    with pytest.raises(TsConfigError, match=r"^the parallel context holds no expert-parallel groups of size 2 "
                                            r"\(built: none\): build it with .*including 2") as e:
        two_data_ranks.expert_parallel(4)
    assert "\n" not in str(e.value)


def test_current_context_is_set_at_the_edge_and_single_process_without_one():
    assert current_parallel_context() == ParallelContext.single_process()
    ctx = ParallelContext(2, 0, (0, 1), (0,), (0,), (0,))
    set_parallel_context(ctx)
    try:
        assert current_parallel_context() is ctx
    finally:
        destroy_parallel_context()
    assert parallel_context._CURRENT is None


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_worker_ranks(WORKER, 4, tmp_path_factory.mktemp("context"))


def expected_groups(rank: int, world: int, t_size: int, p_size: int) -> dict[str, list[int]]:
    """This rank's group of each kind by the enumeration (``[]``: in no embedding group)."""
    found = {kind: [list(g) for g in groups if rank in g]
             for kind, groups in enumerated(world, t_size, p_size).items()}
    return {kind: (g[0] if g else []) for kind, g in found.items()}


@pytest.mark.parametrize("case,t_size,p_size", [("t2p2", 2, 2), ("p4", 1, 4), ("experts", 1, 1)])
def test_built_groups_have_the_layout_members(ranks, case, t_size, p_size):
    for rank, per_rank in enumerate(ranks):
        got = per_rank[case]
        want = expected_groups(rank, 4, t_size, p_size)
        assert (got["world"], got["rank"]) == (4, rank)
        for kind in ("tensor", "data", "pipeline", "embedding"):
            assert got[kind] == want[kind] == got[f"{kind}_ranks"], (rank, case, kind)
        d_size = 4 // (t_size * p_size)
        assert got["sizes"] == [t_size, d_size, p_size]
        t, d, p = rank % t_size, rank // t_size % d_size, rank // (t_size * d_size)
        assert got["positions"] == [t, d, p]
        assert got["stages"] == [p == 0, p == p_size - 1]


def test_embedding_groups_join_first_and_last_stage(ranks):
    assert [r["t2p2"]["embedding"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["p4"]["embedding"] for r in ranks] == [[0, 3], [], [], [0, 3]]


def test_expert_groups_are_built_with_the_context(ranks):
    assert all(r["t2p2"]["expert_groups"] == [] for r in ranks)  # one data-parallel rank: all local
    assert all(r["t2p2"]["experts"]["4/0"] == {"all_to_all": [rank], "replicas": [rank], "first": 0, "local": 4,
                                               "size": 1} for rank, r in enumerate(ranks))
    assert all(r["experts"]["expert_groups"] == [1, 2, 4] for r in ranks)  # every divisor of D = 4
    assert all(r["experts_a2"]["expert_groups"] == [2] for r in ranks)
    for rank, r in enumerate(ranks):
        experts = r["experts"]["experts"]
        # 4 experts over 4 data-parallel ranks: one each, one all-to-all group, no replicas
        assert experts["4/0"] == {"all_to_all": [0, 1, 2, 3], "replicas": [rank], "first": rank, "local": 1,
                                  "size": 4}
        # 2 experts: all-to-all groups {0, 1}, {2, 3}; replicas {0, 2}, {1, 3}
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert experts["2/0"] == {"all_to_all": pair, "replicas": [rank % 2, rank % 2 + 2], "first": rank % 2,
                                  "local": 1, "size": 2}
        assert experts["4/2"] == {"all_to_all": pair, "replicas": [rank % 2, rank % 2 + 2], "first": 2 * (rank % 2),
                                  "local": 2, "size": 2}
        # size 1: every expert on every rank, all four ranks replicas
        assert experts["4/1"] == {"all_to_all": [rank], "replicas": [0, 1, 2, 3], "first": 0, "local": 4, "size": 1}
        # the groups depend on the size alone: 4 experts at size 2 and 2 experts at size 2 share them
        assert r["experts_a2"]["experts"]["4/2"] == experts["4/2"]
        assert r["experts_a2"]["experts"]["2/0"] == experts["2/0"]
        assert r["experts"]["unbuilt"] == r["t2p2"]["unbuilt"] == ""  # every size built / one data-parallel rank
        assert r["experts_a2"]["unbuilt"].startswith("the parallel context holds no expert-parallel groups of size 4 "
                                                      "(built: 2)")
