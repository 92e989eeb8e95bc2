"""Pipeline schedules as each rank's ordered list of steps, and a simulator that checks and
times them.

A pipeline of ``P`` ranks holds ``V`` model chunks per rank (``V > 1``: interleaved, Narayanan
et al. 2021 section 2.2); chunk ``c`` on pipeline rank ``s`` is global stage ``g = c P + s`` of
``P V``. One update runs ``m`` micro-batches (fairseq's ``--update-freq`` batches); a step is
the forward (``F``) or backward (``B``) of one micro-batch through one chunk.

- GPipe (Huang et al. 2019): every forward, then every backward (chunk by chunk when ``V > 1``);
  up to ``m V`` micro-batches' activations held at once.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021 section 2.2.1): ``P - s - 1`` warm-up forwards,
  then one forward and one backward in turn, then the remaining backwards: at most ``P - s``
  micro-batches in flight on rank ``s``.
- interleaved 1F1B (``V > 1``, Megatron-LM's order): micro-batches go through the chunks in
  groups of ``P``; needs ``m`` a multiple of ``P``.

Each rank runs its list with buffered sends and blocking receives (:mod:`.pipeline_parallel`).

Bubble (idle) fraction with forward and backward costs ``f``, ``b`` equal on every stage:
``(P - 1) / m`` of the ideal time for GPipe and 1F1B, ``(P - 1) / (V m)`` interleaved.
:func:`simulate` runs the lists with given per-stage costs, blocking receives and buffered
sends: a deadlock or a message received out of the order it was sent between two ranks is an error, and the result is each
rank's busy time and the makespan (for any ``P``, e.g. a cluster's 8 or 16 stages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchscale_fairseq.errors import TsConfigError

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Step:
    """The forward (``kind="F"``) or backward (``"B"``) of ``microbatch`` through ``chunk``."""

    kind: str
    chunk: int
    microbatch: int


def global_stage(chunk: int, pipeline_rank: int, pipeline_size: int) -> int:
    return chunk * pipeline_size + pipeline_rank


def gpipe_steps(pipeline_size: int, pipeline_rank: int, microbatches: int, chunks: int = 1) -> list[Step]:
    """Every forward (chunk by chunk), then every backward (chunks in reverse)."""
    forwards = [Step("F", c, i) for c in range(chunks) for i in range(microbatches)]
    backwards = [Step("B", c, i) for c in reversed(range(chunks)) for i in range(microbatches)]
    return forwards + backwards


def one_f_one_b_steps(pipeline_size: int, pipeline_rank: int, microbatches: int) -> list[Step]:
    """1F1B on rank ``pipeline_rank`` of ``pipeline_size`` (one chunk)."""
    warmup = min(pipeline_size - pipeline_rank - 1, microbatches)
    steps = [Step("F", 0, i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        steps += [Step("F", 0, warmup + i), Step("B", 0, i)]
    steps += [Step("B", 0, i) for i in range(microbatches - warmup, microbatches)]
    return steps


def interleaved_steps(pipeline_size: int, pipeline_rank: int, microbatches: int, chunks: int) -> list[Step]:
    """Megatron-LM's interleaved 1F1B: virtual micro-batch ``k`` is micro-batch
    ``(k // (P V)) P + k % P`` through chunk ``(k // P) % V`` forward (``V - 1 -`` that backward);
    warm-up ``2 (P - s - 1) + (V - 1) P`` forwards (all of them when ``m = P``)."""
    p, v, m = pipeline_size, chunks, microbatches
    if m % p != 0:
        raise TsConfigError(
            f"the interleaved schedule runs micro-batches in groups of the pipeline size {p} but an update has {m}: "
            "use an --update-freq that is a multiple of --pipeline-model-parallel-size"
        )
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    warmup = total if m == p else min(2 * (p - pipeline_rank - 1) + (v - 1) * p, total)
    steps = [Step("F", chunk(k, True), microbatch(k)) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [Step("F", chunk(warmup + k, True), microbatch(warmup + k)), Step("B", chunk(k, False), microbatch(k))]
    steps += [Step("B", chunk(k, False), microbatch(k)) for k in range(total - warmup, total)]
    return steps


def schedule_steps(schedule: str, pipeline_size: int, pipeline_rank: int, microbatches: int,
                   chunks: int = 1) -> list[Step]:
    """The steps of rank ``pipeline_rank`` for ``--pipeline-schedule schedule`` with ``chunks``
    virtual stages per rank (1F1B with ``chunks > 1`` is the interleaved schedule; an update of
    micro-batches not a multiple of the pipeline size, as an epoch's last can be, runs GPipe's order)."""
    if schedule == "gpipe":
        return gpipe_steps(pipeline_size, pipeline_rank, microbatches, chunks)
    if schedule != "1f1b":
        raise TsConfigError(f"--pipeline-schedule {schedule!r} is not a schedule: choose one of {', '.join(SCHEDULES)}")
    if chunks > 1 and microbatches % pipeline_size != 0:
        return gpipe_steps(pipeline_size, pipeline_rank, microbatches, chunks)
    if chunks > 1:
        return interleaved_steps(pipeline_size, pipeline_rank, microbatches, chunks)
    return one_f_one_b_steps(pipeline_size, pipeline_rank, microbatches)


def forward_only_steps(microbatches: int, chunks: int = 1) -> list[Step]:
    """Validation: every micro-batch forward through every chunk, no backward."""
    return [Step("F", c, i) for c in range(chunks) for i in range(microbatches)]


@dataclass
class Simulation:
    """Per pipeline rank: busy time, the most micro-batches in flight (forwarded, not yet
    backwarded); the makespan of the update."""

    busy: list[float]
    in_flight: list[int]
    makespan: float

    @property
    def bubble(self) -> list[float]:
        """Each rank's idle fraction of the makespan."""
        return [1.0 - b / self.makespan for b in self.busy]


def simulate(steps: Sequence[Sequence[Step]], chunks: int = 1, forward_cost: Sequence[float] | float = 1.0,
             backward_cost: Sequence[float] | float = 2.0, p2p_cost: float = 0.0) -> Simulation:
    """Run every rank's ``steps`` (index = pipeline rank) as the executor does: a step starts when
    the rank is free and its input has arrived (``p2p_cost`` after the neighbour finished); costs per
    global stage (or one for all). Raises on a deadlock, on a message a rank receives out of the order
    it was sent on its channel (NCCL matches point-to-point messages by order), or on a missing step."""
    p = len(steps)
    stages = p * chunks
    f_cost = [float(forward_cost)] * stages if isinstance(forward_cost, (int, float)) else list(forward_cost)
    b_cost = [float(backward_cost)] * stages if isinstance(backward_cost, (int, float)) else list(backward_cost)
    done: dict[tuple[str, int, int], float] = {}  # (kind, global stage, microbatch) -> finish time
    sent: dict[tuple[int, int], list[tuple[int, int]]] = {}  # channel -> (stage, microbatch) in send order
    received: dict[tuple[int, int], int] = {}
    position, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    live, most = [0] * p, [0] * p
    microbatches = {s.microbatch for rank_steps in steps for s in rank_steps}
    for rank, rank_steps in enumerate(steps):
        expected = {(k, c, i) for k in "FB" for c in range(chunks) for i in microbatches}
        if {(s.kind, s.chunk, s.microbatch) for s in rank_steps} != expected and any(s.kind == "B" for s in rank_steps):
            raise AssertionError(f"rank {rank} does not run every forward and backward once")
    while any(position[r] < len(steps[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if position[r] == len(steps[r]):
                continue
            step = steps[r][position[r]]
            g = global_stage(step.chunk, r, p)
            if step.kind == "F":
                source, needed = (g - 1, ("F", g - 1, step.microbatch)) if g > 0 else (None, None)
            else:
                source, needed = (g + 1, ("B", g + 1, step.microbatch)) if g < stages - 1 else (None, None)
                if ("F", g, step.microbatch) not in done:
                    raise AssertionError(f"rank {r}: backward of micro-batch {step.microbatch} before its forward")
            start = clock[r]
            if needed is not None:
                if needed not in done:
                    continue
                channel = (source % p, r)
                order = sent.get(channel, [])
                k = received.get(channel, 0)
                if k >= len(order) or order[k] != (source, step.microbatch):
                    raise AssertionError(f"rank {r} receives {step} out of the order its channel {channel} carries")
                received[channel] = k + 1
                start = max(start, done[needed] + p2p_cost)
            cost = (f_cost if step.kind == "F" else b_cost)[g]
            clock[r] = start + cost
            busy[r] += cost
            done[(step.kind, g, step.microbatch)] = clock[r]
            target = g + 1 if step.kind == "F" else g - 1
            if 0 <= target < stages:
                sent.setdefault((r, target % p), []).append((g, step.microbatch))
            live[r] += 1 if step.kind == "F" else -1
            most[r] = max(most[r], live[r])
            position[r] += 1
            progressed = True
        if not progressed:
            stuck = {r: steps[r][position[r]] for r in range(p) if position[r] < len(steps[r])}
            raise AssertionError(f"the schedule deadlocks: ranks wait at {stuck}")
    return Simulation(busy, most, max(clock))
