"""The parallel context: the rank layout of every group against an independent enumeration and
Megatron-core's construction loops (tensor fastest, then data, then pipeline), its one-line
errors, the single-process context, the expert-layout lookup, and on 4 gloo ranks the groups
the building function creates (``T = 2 x P = 2``, ``P = 4``, experts over ``D = 4`` at every
expert-parallel size or one), their members found by an all-reduce inside each group."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.cli_utils import WORKERS
from tests.helpers.mp_helpers import (
    USER_DIR,
    dist_flags,
    fairseq_ranks,
    launch,
    make_corpora,
    relative_close,
    run_worker_ranks,
    train_records,
    wait_all,
)
from tests.helpers.rendezvous import rendezvous_url
from tests.workers.cleared_context_cli import CLEARED
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel import parallel_context
from torchscale_fairseq.model_parallel.parallel_context import (
    ParallelContext,
    current_parallel_context,
    destroy_parallel_context,
    parallel_groups_layout,
    set_parallel_context,
)

WORKER = WORKERS / "context_worker.py"
CLEARED_CLI = WORKERS / "cleared_context_cli.py"
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


def test_expert_groups_span_data_and_context_ranks(ranks):
    """C = 2 x D = 2 (rank = c + 2 d): the default layout puts 4 experts on all 4 data-context ranks;
    at size 2 the all-to-all pairs are the context-parallel groups {0, 1}, {2, 3}, the replicas
    the data-parallel groups {0, 2}, {1, 3}."""
    for rank, r in enumerate(ranks):
        case = r["experts_c2"]
        assert case["data"] == [rank % 2, rank % 2 + 2] and case["expert_groups"] == [1, 2, 4]
        assert case["experts"]["4/0"] == {"all_to_all": [0, 1, 2, 3], "replicas": [rank], "first": rank, "local": 1,
                                          "size": 4}
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert case["experts"]["4/2"] == {"all_to_all": pair, "replicas": [rank % 2, rank % 2 + 2],
                                          "first": 2 * (rank % 2), "local": 2, "size": 2}


UPDATES = 2
# a 4-layer Magneto ts_lm with X-MoE in layers 2 and 4, SparseClip and the z-loss; "all" keeps both
# experts of every token, so routing draws nothing that --update-freq would advance
TRAIN = ["--task", "language_modeling", "--arch", "ts_lm_tiny", "--decoder-layers", "4", "--decoder-embed-dim", "64",
         "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4", "--tokens-per-sample", "32",
         "--batch-size", "4", "--max-update", str(UPDATES), "--lr", "1e-3", "--clip-norm", "0.5", "--dropout", "0",
         "--log-format", "json", "--log-interval", "1", "--no-save", "--ddp-backend", "legacy_ddp", "--seed", "3",
         "--validate-interval-updates", "2", "--max-valid-steps", "4", "--moe-expert-count", "4", "--moe-freq", "2",
         "--moe-second-expert-policy", "all", "--optimizer", "sparse_clip", "--sparse-clip-base", "adam",
         "--moe-z-loss-wt", "0.001", "--criterion", "moe_cross_entropy"]
TP2_PP2_DP2 = ["--model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--update-freq", "4"]
KEYS = ("loss", "gnorm", "moe_gate_loss", "moe_z_loss", "moe_cv_dec1", "moe_cv_dec3", "moe_drop", "gnorm_dense",
        "gnorm_expert")


def test_tp_pp_ep_training_needs_no_module_global(tmp_path):
    """fairseq-train at TP = 2 x PP = 2 x DP = 2 (8 gloo ranks, the experts spread over the two
    data-parallel ranks and split over the tensor-parallel pair) with the module global cleared once
    the trainer is built trains and validates like one process accumulating both pipelines' batches
    (``--update-freq 8``): every step, the gradient norm, the expert sync and validation find their
    groups in what the factories kept."""
    lm_bin, _ = make_corpora(tmp_path)
    one_procs, one_logs = fairseq_ranks("fairseq-train", [str(lm_bin), *TRAIN, "--update-freq", "8"], 1,
                                        tmp_path / "one", unrounded=True)
    world, init_method = 8, rendezvous_url(tmp_path / "cleared")
    logs = [tmp_path / "cleared" / f"rank{r}.log" for r in range(world)]
    procs = [launch([sys.executable, str(CLEARED_CLI), "fairseq-train", str(lm_bin), *TRAIN, *TP2_PP2_DP2,
                     "--save-dir", str(tmp_path / "cleared" / "checkpoints"), "--user-dir", str(USER_DIR), "--cpu",
                     *dist_flags(world, r, init_method)], logs[r])
             for r in range(world)]
    wait_all([*procs, *one_procs], [*logs, *one_logs], timeout=900)
    assert all(CLEARED in log.read_text() for log in logs)
    ours, theirs = train_records(logs[0]), train_records(one_logs[0])
    assert len(ours) == len(theirs) == UPDATES
    for update, (a, b) in enumerate(zip(ours, theirs), start=1):
        for key in KEYS:
            assert relative_close(float(a[key]), float(b[key]), 1e-5), f"update {update} {key}: {a[key]} vs {b[key]}"
    valid = [line for line in logs[0].read_text().splitlines() if "valid_loss" in line]
    valid_ref = [line for line in one_logs[0].read_text().splitlines() if "valid_loss" in line]
    assert len(valid) == len(valid_ref) == 1
    loss, loss_ref = (float(line[line.index("{"):].split('"valid_loss": "')[1].split('"')[0])
                      for line in (valid[0], valid_ref[0]))
    assert relative_close(loss, loss_ref, 1e-5), (loss, loss_ref)
