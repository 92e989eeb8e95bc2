"""The pipeline schedules and the layer split, without processes: every schedule runs every
forward and backward once, never deadlocks, receives every message in the order it was sent,
and its bubble and in-flight micro-batches equal the published formulas (GPipe and 1F1B:
``(P - 1) / m`` of the ideal time, interleaved ``(P - 1) / (V m)``; 1F1B holds ``P - s``
micro-batches on stage ``s``, GPipe ``m``)."""

from __future__ import annotations

import pytest

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.pipeline_parallel import (
    PipelineSplit,
    chunk_layer_ranges,
    parse_layer_counts,
    stage_layer_counts,
)
from torchscale_fairseq.model_parallel.pipeline_schedules import (
    Step,
    gpipe_steps,
    interleaved_steps,
    schedule_steps,
    simulate,
)

FORWARD, BACKWARD = 1.0, 2.0


def _all_ranks(schedule: str, p: int, m: int, v: int = 1) -> list[list[Step]]:
    return [schedule_steps(schedule, p, s, m, v) for s in range(p)]


CASES = [(p, m, schedule, v) for p in (2, 4, 8) for m in (4, 8, 16)
         for schedule, v in (("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("1f1b", 3), ("gpipe", 2))
         if not (schedule == "1f1b" and v > 1 and m % p != 0)]  # (interleaving: m a multiple of P)


@pytest.mark.parametrize("p,m,schedule,v", CASES)
def test_bubble_and_memory_equal_the_formulas(p, m, schedule, v):
    sim = simulate(_all_ranks(schedule, p, m, v), v, FORWARD / v, BACKWARD / v)
    ideal = m * (FORWARD + BACKWARD)
    formula = ideal * (1 + (p - 1) / (v * m))
    if v > 1 and m < p:  # chunk by chunk, stage 0 waits for the first micro-batch to come round
        assert sim.makespan > formula
    else:
        assert sim.makespan == pytest.approx(formula)
    assert all(b == pytest.approx(ideal) for b in sim.busy)
    if schedule == "gpipe":
        assert sim.in_flight == [m * v] * p
    elif v == 1:
        assert sim.in_flight == [min(p - s, m) for s in range(p)]
    elif m == p:  # interleaved with one group of micro-batches: every forward first
        assert sim.in_flight == [m * v] * p
    else:  # interleaved: at most its warm-up plus one
        assert all(f <= 2 * (p - s - 1) + (v - 1) * p + 1 for s, f in enumerate(sim.in_flight)), sim.in_flight


def test_uneven_stage_costs_bound_the_step():
    """With one slow stage the step is set by it: GPipe and 1F1B take (m + P - 1) x its cost."""
    p, m = 4, 8
    costs = [1.0, 1.0, 3.0, 1.0]
    for schedule in ("gpipe", "1f1b"):
        sim = simulate(_all_ranks(schedule, p, m), 1, costs, [2 * c for c in costs])
        assert sim.makespan >= m * 9.0 and sim.busy[2] == pytest.approx(m * 9.0)


def test_interleaving_falls_back_to_gpipe_order_for_a_short_update():
    """An epoch's last update can hold fewer micro-batches than a multiple of P."""
    steps = _all_ranks("1f1b", 4, 6, 2)
    assert steps[0] == gpipe_steps(4, 0, 6, 2)
    simulate(steps, 2)
    with pytest.raises(TsConfigError, match="multiple of --pipeline-model-parallel-size"):
        interleaved_steps(4, 0, 6, 2)


def test_the_simulator_finds_a_deadlock_and_a_missing_step():
    good = _all_ranks("1f1b", 2, 4)
    backward_first = [list(good[0]), [good[1][1], good[1][0], *good[1][2:]]]  # rank 1: B(0) before F(0)
    with pytest.raises(AssertionError, match="before its forward"):
        simulate(backward_first)
    wait_for_each_other = [[Step("F", 0, 1), Step("F", 0, 0), Step("B", 0, 0), Step("B", 0, 1)],
                           [Step("F", 0, 0), Step("B", 0, 0), Step("F", 0, 1), Step("B", 0, 1)]]
    with pytest.raises(AssertionError, match="out of the order|deadlocks"):
        simulate(wait_for_each_other)
    with pytest.raises(AssertionError, match="every forward and backward once"):
        simulate([good[0][:-1], good[1]])


def test_layer_split():
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert stage_layer_counts(5, 2, [1, 4]) == [1, 4]
    assert parse_layer_counts("1,4") == [1, 4] and parse_layer_counts(None) is None
    for counts, p in (([2, 2, 2, 2], 2), ([1, 3, 2, 2, 1, 3], 3), ([3, 5], 2)):
        held = [i for s in range(p) for r in chunk_layer_ranges(counts, p, s) for i in r]
        assert sorted(held) == list(range(sum(counts)))
    # interleaved: rank 0 holds global stages 0 and 2
    assert chunk_layer_ranges([1, 2, 3, 4], 2, 0) == [range(0, 1), range(3, 6)]
    split = PipelineSplit.for_rank(8, 2, 1, 2)
    assert split.chunk_stages == (1, 3) and split.holds_last_stage and not split.holds_first_stage
    assert split.chunk_layers == (range(2, 4), range(6, 8))
    whole = PipelineSplit.whole(6)
    assert whole.is_first(0) and whole.is_last(0) and whole.holds_layer(5)


@pytest.mark.parametrize("call,match", [
    (lambda: stage_layer_counts(6, 4), "do not split evenly into 4 pipeline stage.*set --pipeline-layers, e.g. 2,2,1,1"),
    (lambda: stage_layer_counts(6, 2, [2, 2]), "6 layers in all"),
    (lambda: stage_layer_counts(6, 2, [0, 6]), "at least one layer each"),
    (lambda: parse_layer_counts("2,x"), "not a comma separated list"),
    (lambda: schedule_steps("pipedream", 2, 0, 4), "is not a schedule"),
])
def test_bad_splits_are_one_line_errors(call, match):
    with pytest.raises(TsConfigError, match=match):
        call()
