"""Ring attention (``model_parallel/context_parallel.py``) on gloo processes, C = 2, 3, 4: every
rank's output and query/key/value gradients equal those of plain causal attention on the whole
sequence, also with document masks (ring blocks with fully masked query rows included); each
rank sends the bytes of the module docstring's formula; the load-balanced chunks
cover the sequence once. The rank layout with a context-parallel size against an independent
enumeration of ``global rank = t + T (c + C (d + D p))``; the refusals of ``--context-parallel-size``
are one line each."""

from __future__ import annotations

import itertools
from argparse import Namespace

import pytest
import torch

from tests.helpers.cli_utils import WORKERS
from tests.helpers.mp_helpers import run_worker_ranks
from torchscale_fairseq.architecture.config import check_context_parallel
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.context_parallel import context_parallel_indices, pad_to_multiple
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext, parallel_groups_layout

WORKER = WORKERS / "ring_attention_worker.py"
TOL = {"float64": 1e-12, "float32": 2e-5, "float64_documents": 1e-12}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_worker_ranks(WORKER, 4, tmp_path_factory.mktemp("ring"))


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype", list(TOL))
def test_ring_attention_equals_full_causal_attention(results, size, dtype):
    """``float64_documents``: with document masks, against causal attention within documents."""
    ranks = results[str(size)]
    assert len(ranks) == size
    for rank in ranks:
        for name, error in rank[dtype]["errors"].items():
            assert error < TOL[dtype], (size, name, error)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_ring_sends_the_formula(results, size):
    for rank in results[str(size)]:
        b, h, length, d = rank["float64"]["shape"]
        block = b * h * (length // size) * d  # one rank's keys (or values)
        assert rank["float64"]["sent"]["forward"] == (size - 1) * 2 * block
        assert rank["float64"]["sent"]["backward"] == (size - 1) * 2 * block + size * 2 * block


@pytest.mark.parametrize("size", [1, 2, 3])
def test_chunks_cover_the_sequence_once_balanced(size):
    length = 12 * size
    held = [context_parallel_indices(length, size, r) for r in range(size)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(length))
    causal_work = [int((idx + 1).sum()) for idx in held]  # keys each rank's queries see
    assert len(set(causal_work)) == 1


def test_length_not_split_into_2c_chunks_is_one_line():
    with pytest.raises(TsConfigError, match="does not split into 4 equal chunks"):
        context_parallel_indices(10, 2, 0)


def test_pad_to_multiple():
    tokens = torch.arange(10).view(2, 5)
    padded = pad_to_multiple(tokens, 4, -1)
    assert padded.shape == (2, 8) and torch.equal(padded[:, :5], tokens) and bool((padded[:, 5:] == -1).all())


def enumerated(world: int, t: int, c: int, p: int) -> dict[str, set[tuple[int, ...]]]:
    """Each group as the ranks sharing the other coordinates of ``(t, c, d, p)``, read off each rank
    as mixed-radix digits (``t`` fastest, then ``c``, ``d``, ``p``); data-context shares ``(t, p)``."""
    d = world // (t * c * p)
    coords = {r: (r % t, r // t % c, r // (t * c) % d, r // (t * c * d)) for r in range(world)}
    keys = {"tensor": (1, 2, 3), "context": (0, 2, 3), "data": (0, 1, 3), "pipeline": (0, 1, 2), "data_context": (0, 3)}
    out = {}
    for kind, kept in keys.items():
        groups: dict[tuple, list[int]] = {}
        for r, xs in coords.items():
            groups.setdefault(tuple(xs[i] for i in kept), []).append(r)
        out[kind] = {tuple(g) for g in groups.values()}
    return out


@pytest.mark.parametrize("world,t,c,p", [(4, 1, 2, 1), (4, 2, 2, 1), (8, 2, 2, 1), (8, 1, 2, 2), (16, 2, 2, 2),
                                         (12, 1, 3, 2), (8, 1, 4, 1)])
def test_layout_with_context_parallelism_equals_enumeration(world, t, c, p):
    layout = parallel_groups_layout(world, t, p, c)
    expected = enumerated(world, t, c, p)
    for kind in expected:
        groups = getattr(layout, kind)
        assert {tuple(g) for g in groups} == expected[kind], kind
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(world)), kind
    assert all(len(g) == c for g in layout.context)
    assert all(len(g) == world // (t * p) for g in layout.data_context)


def test_context_size_not_dividing_the_ranks_is_one_line():
    with pytest.raises(TsConfigError, match=r"^--context-parallel-size 3 does not divide the 4 rank\(s\)") as e:
        parallel_groups_layout(8, 2, 1, 3)
    assert "\n" not in str(e.value)


def test_context_defaults_to_this_rank_and_the_data_group():
    ctx = ParallelContext(4, 1, (1,), (1, 3), (1,), (1,))
    assert (ctx.context_size, ctx.context_rank, ctx.data_context_ranks, ctx.data_context_rank) == (1, 0, (1, 3), 0)


TWO = ParallelContext(2, 1, (1,), (1,), (1,), (1,), context_ranks=(0, 1), data_context_ranks=(0, 1))
LM = dict(tokens_per_sample=32, attention_dropout=0.0, moe_freq=0, moe_expert_count=0)


@pytest.mark.parametrize("part,extra,needle", [
    ("encoder_only", {}, "splits the causal self-attention of ts_lm's decoder; the encoder only stack"),
    ("encdec_decoder", {}, "the encdec decoder stack attends bidirectionally or across"),
    ("decoder_only", {"moe_freq": 2, "moe_expert_count": 4, "moe_router": "expert_choice"},
     "splits the batch each expert of --moe-router expert_choice picks its tokens from"),
    ("decoder_only", {"xpos": True}, "does not compose with --xpos"),
    ("decoder_only", {"rel_pos_buckets": 32}, "does not compose with --rel-pos-buckets"),
    ("decoder_only", {"attention_dropout": 0.1}, "runs its ring attention without dropout"),
    ("decoder_only", {"tokens_per_sample": 30}, "--tokens-per-sample 30 does not split into 4 equal chunks"),
])
def test_refusals_are_one_line(part, extra, needle):
    with pytest.raises(TsConfigError, match="^--") as e:
        check_context_parallel(Namespace(**{**LM, **extra}), part, TWO)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("extra", [{}, {"pipeline_model_parallel_size": 2},
                                   {"moe_freq": 2, "moe_expert_count": 4, "moe_router": "xmoe"}])
def test_supported_lm_passes(extra):
    check_context_parallel(Namespace(**{**LM, **extra}), "decoder_only", TWO)
