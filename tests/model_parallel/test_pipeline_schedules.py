"""The pipeline schedules and the layer split, without processes: every schedule, as the
executor issues it, runs every forward and backward once, never deadlocks under NCCL's
point-to-point semantics (P = 2..8, m = 1..16, V = 1..4), receives every message in the order it
was sent, and its bubble and in-flight micro-batches equal the published formulas (GPipe and 1F1B:
``(P - 1) / m`` of the ideal time; interleaved between ``(P - 1) / (V m)`` and that, its waited
batches holding a forward until the paired backward's gradient is in; 1F1B holds ``P - s``
micro-batches on stage ``s``, GPipe ``m``); today's unbatched sends and blocking receives
deadlock there."""

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
    Post,
    Step,
    executor_program,
    forward_only_steps,
    gpipe_steps,
    interleaved_steps,
    schedule_steps,
    simulate,
    step_input,
    step_output,
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
    elif schedule == "1f1b" and v > 1 and m > p:  # the steady state's batches wait for the backward's gradient
        assert formula - 1e-9 <= sim.makespan <= ideal * (1 + (p - 1) / m) + 1e-9
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


NCCL_CASES = [(schedule, p, m, v) for p in range(2, 9) for m in range(1, 17) for v in range(1, 5)
              for schedule in ("gpipe", "1f1b")
              if not (schedule == "1f1b" and v == 1 and m < p)]  # (1F1B: --update-freq >= P, checked at start)


def test_every_schedule_is_deadlock_free_under_nccl_semantics():
    """GPipe, 1F1B and interleaved 1F1B (with its GPipe-order fall-back when m is not a multiple of
    P), as the executor batches them, for P = 2..8, m = 1..16, V = 1..4: every rank finishes, every
    message meets its receive in channel order; every rank's batches hold at most one send and one
    receive per step, and a rank posting a send also receiving in that step posts them together."""
    for schedule, p, m, v in NCCL_CASES:
        steps = _all_ranks(schedule, p, m, v)
        sim = simulate(steps, v)
        assert sim.makespan > 0, (schedule, p, m, v)
        if schedule == "gpipe":  # validation's forward-only steps
            assert simulate([forward_only_steps(p, m, v)] * p, v).busy == [m * v * 1.0] * p
        for rank, rank_steps in enumerate(steps):
            program = executor_program(rank_steps, rank, p, v)
            posts = [item for item in program if isinstance(item, Post)]
            transfers = [t for post in posts for t in post.transfers]
            expected = [t for s in rank_steps for t in (step_input(s, rank, p, v), step_output(s, rank, p, v)) if t]
            assert sorted(map(repr, transfers)) == sorted(map(repr, expected)), (schedule, p, m, v, rank)
            assert all(post.wait for post in posts)


def _unbatched_program(steps, rank, p, chunks):
    """Today's executor: a blocking receive before a step, a buffered (unwaited) send after it."""
    program = []
    for step in steps:
        receive, send = step_input(step, rank, p, chunks), step_output(step, rank, p, chunks)
        if receive is not None:
            program.append(Post((receive,), wait=True))
        program.append(step)
        if send is not None:
            program.append(Post((send,), wait=False))
    return program


def test_the_simulator_flags_unbatched_sends_then_receives_as_a_deadlock():
    """1F1B's steady state with an ``isend`` then a blocking ``recv``: neighbours each send before
    they receive, and under NCCL (no buffering, a pair's operations in order) neither send completes.
    The same pattern passes when the simulator is told sends are buffered (each one its own pair
    order is what blocks), and the executor's batches pass."""
    steps = _all_ranks("1f1b", 2, 4)
    with pytest.raises(AssertionError, match="deadlocks under NCCL semantics"):
        simulate(steps, program=_unbatched_program)
    simulate(steps)
    gpipe = _all_ranks("gpipe", 2, 4)  # GPipe never sends and receives on one pair at once: it passes too
    simulate(gpipe, program=_unbatched_program)


def test_executor_program_batches_megatron_style():
    """1F1B on the middle rank of 3: a forward's send and the next backward's receive in one batch
    (``send_forward_recv_backward``), a backward's send and the next forward's receive in one
    (``send_backward_recv_forward``)."""
    program = executor_program(schedule_steps("1f1b", 3, 1, 4), 1, 3)
    pairs = [tuple((t.send, t.message.kind) for t in item.transfers) for item in program if isinstance(item, Post)]
    assert ((True, "F"), (False, "B")) in pairs and ((True, "B"), (False, "F")) in pairs


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
