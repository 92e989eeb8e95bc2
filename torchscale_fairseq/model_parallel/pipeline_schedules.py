"""Pipeline schedules as each rank's ordered list of steps, and a simulator that checks and
times them.

A pipeline of ``P`` ranks holds ``V`` model chunks per rank (``V > 1``: interleaved, Narayanan
et al. 2021 section 2.2); chunk ``c`` on pipeline rank ``s`` is global stage ``g = c P + s`` of
``P V``. One update runs ``m`` micro-batches (fairseq's ``--update-freq`` batches); a step is
the forward (``F``) or backward (``B``) of one micro-batch through one chunk.

- GPipe (Huang et al. 2019): every forward, then every backward (with ``V > 1`` in groups of ``P``
  micro-batches chunk by chunk); up to ``m V`` micro-batches' activations held at once.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021 section 2.2.1): ``P - s - 1`` warm-up forwards,
  then one forward and one backward in turn, then the remaining backwards: at most ``P - s``
  micro-batches in flight on rank ``s``.
- interleaved 1F1B (``V > 1``, Megatron-LM's order): micro-batches go through the chunks in
  groups of ``P``; needs ``m`` a multiple of ``P``.

Each rank runs its list as a *program* (:func:`executor_program`): before each step one batch of
point-to-point operations (the previous step's output sent, this step's input received) is posted
at once and waited, as Megatron-core's ``send_forward_recv_backward`` and friends; after the last
step, its output is sent. The executor (:func:`~.pipeline_parallel.run_steps`) runs exactly this
program.

Bubble (idle) fraction with forward and backward costs ``f``, ``b`` equal on every stage and free
messages: ``(P - 1) / m`` of the ideal time for GPipe and 1F1B, ``(P - 1) / (V m)`` interleaved
with messages that never hold a rank up. With waited batches (Megatron-core without
``--overlap-p2p-comm``) the interleaved steady state receives a backward's gradient before the
forward paired with it, and its bubble lies between the two.
:func:`simulate` runs the programs with given per-stage costs under NCCL's point-to-point
semantics: the operations between two ranks share one stream and complete in issue order (a
posted batch runs as one group), a send completes only once its receive is posted on the peer (no buffering, the
worst case of a message larger than NCCL's buffers), and the ``k``-th send on a channel meets the
``k``-th receive. A deadlock or a message received out of the order it was sent is an error; the
result is each rank's busy time and the makespan (for any ``P``, e.g. a cluster's 8 or 16 stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
    """Every forward, then every backward. With ``chunks > 1`` the micro-batches go through the
    chunks in groups of the pipeline size (the last group may be smaller), forward chunk by chunk
    and backward in reverse, as the interleaved schedule orders them: the last stage of a chunk
    never runs more than ``P`` micro-batches ahead of the first stage of the next, which receives
    them (without buffered sends, as under NCCL, a longer lead deadlocks)."""
    groups = [range(start, min(start + pipeline_size, microbatches)) for start in range(0, microbatches, pipeline_size)]
    forwards = [Step("F", c, i) for group in groups for c in range(chunks) for i in group]
    backwards = [Step("B", c, i) for group in groups for c in reversed(range(chunks)) for i in group]
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


def forward_only_steps(pipeline_size: int, microbatches: int, chunks: int = 1) -> list[Step]:
    """Validation: every micro-batch forward through every chunk, no backward (in GPipe's order)."""
    return [step for step in gpipe_steps(pipeline_size, 0, microbatches, chunks) if step.kind == "F"]


@dataclass(frozen=True)
class Message:
    """What travels between two stages: the hidden states (``kind="F"``) or their gradient
    (``"B"``) of ``microbatch``, sent by global stage ``stage``."""

    kind: str
    stage: int
    microbatch: int


@dataclass(frozen=True)
class Transfer:
    """One point-to-point operation: ``message`` sent to (``send``) or received from pipeline rank
    ``peer``."""

    send: bool
    peer: int
    message: Message


@dataclass(frozen=True)
class Post:
    """Operations posted together (one ``batch_isend_irecv``); ``wait``: the rank waits for all of
    them before going on."""

    transfers: tuple[Transfer, ...]
    wait: bool = True


Program = list[Step | Post]  # in the order a rank issues them


def step_input(step: Step, pipeline_rank: int, pipeline_size: int, chunks: int) -> Transfer | None:
    """The receive ``step`` needs first: the previous stage's hidden states (a forward, not on
    global stage 0) or the next stage's gradient (a backward, not on the last global stage)."""
    g, last = global_stage(step.chunk, pipeline_rank, pipeline_size), pipeline_size * chunks - 1
    source = g - 1 if step.kind == "F" else g + 1
    if not 0 <= source <= last:
        return None
    return Transfer(False, source % pipeline_size, Message(step.kind, source, step.microbatch))


def step_output(step: Step, pipeline_rank: int, pipeline_size: int, chunks: int) -> Transfer | None:
    """The send ``step`` ends with: its hidden states to the next stage (a forward, not on the last
    global stage) or its input's gradient to the previous one (a backward, not on stage 0)."""
    g, last = global_stage(step.chunk, pipeline_rank, pipeline_size), pipeline_size * chunks - 1
    target = g + 1 if step.kind == "F" else g - 1
    if not 0 <= target <= last:
        return None
    return Transfer(True, target % pipeline_size, Message(step.kind, g, step.microbatch))


def step_units(steps: Sequence[Step], chunks: int = 1) -> list[list[Step]]:
    """The steps in the groups the executor runs between two batches of transfers: one step each,
    but in the interleaved steady state (``chunks > 1``, a forward followed by a backward, more
    forwards to come) the pair together, as Megatron-core's: its neighbours run the same pair in the
    opposite direction, so each rank posts both receives before either send waits."""
    units: list[list[Step]] = []
    forwards_left = sum(step.kind == "F" for step in steps)
    for step in steps:
        forwards_left -= step.kind == "F"
        pair = units and len(units[-1]) == 1 and units[-1][0].kind == "F" and forwards_left > 0
        if chunks > 1 and step.kind == "B" and pair:
            units[-1].append(step)
        else:
            units.append([step])
    return units


def executor_program(steps: Sequence[Step], pipeline_rank: int, pipeline_size: int, chunks: int = 1) -> Program:
    """What the executor issues for ``steps``: before each unit of :func:`step_units` one batch of
    the previous unit's sends and this unit's receives, waited; after the last unit its sends."""
    program: Program = []
    previous: list[Step] = []
    for unit in [*step_units(steps, chunks), []]:
        sends = [step_output(s, pipeline_rank, pipeline_size, chunks) for s in previous]
        receives = [step_input(s, pipeline_rank, pipeline_size, chunks) for s in unit]
        transfers = tuple(t for t in sends + receives if t is not None)
        if transfers:
            program.append(Post(transfers))
        program.extend(unit)
        previous = unit
    return program


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


@dataclass
class _Group:
    """A posted :class:`Post` on a rank: when it was posted, became active (every earlier group of
    the rank with one of its ``peers`` done) and completed; per transfer, its index on its channel."""

    post: Post
    posted: float
    slots: list[tuple[tuple[int, int], int]]
    peers: set[int]
    active: float | None = None
    done: float | None = None
    finished: dict[int, float] = field(default_factory=dict)


def simulate(steps: Sequence[Sequence[Step]], chunks: int = 1, forward_cost: Sequence[float] | float = 1.0,
             backward_cost: Sequence[float] | float = 2.0, p2p_cost: float = 0.0,
             program: Callable[[Sequence[Step], int, int, int], Program] = executor_program) -> Simulation:
    """Run every rank's ``steps`` (index = pipeline rank) as the programs ``program`` makes of them
    (the executor's by default) issue them, under the NCCL semantics of the module docstring: a
    step runs when the rank's host reaches it; a transfer completes ``p2p_cost`` after both its
    send and its receive are active; costs per global stage (or one for all). Raises on a deadlock,
    on a message received out of the order it was sent on its channel, on a backward before its
    forward, or on a missing step."""
    p = len(steps)
    stages = p * chunks
    f_cost = [float(forward_cost)] * stages if isinstance(forward_cost, (int, float)) else list(forward_cost)
    b_cost = [float(backward_cost)] * stages if isinstance(backward_cost, (int, float)) else list(backward_cost)
    microbatches = {s.microbatch for rank_steps in steps for s in rank_steps}
    for rank, rank_steps in enumerate(steps):
        expected = {(k, c, i) for k in "FB" for c in range(chunks) for i in microbatches}
        if {(s.kind, s.chunk, s.microbatch) for s in rank_steps} != expected and any(s.kind == "B" for s in rank_steps):
            raise AssertionError(f"rank {rank} does not run every forward and backward once")
    programs = [program(rank_steps, r, p, chunks) for r, rank_steps in enumerate(steps)]
    position, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    live, most = [0] * p, [0] * p
    forwarded: set[tuple[int, int]] = set()
    streams: list[list[_Group]] = [[] for _ in range(p)]
    posted_on: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}  # (src, dst, send) -> (rank, group index)
    messages: dict[tuple[int, int, bool], list[Message]] = {}

    def channel(rank: int, t: Transfer) -> tuple[int, int]:
        return (rank, t.peer) if t.send else (t.peer, rank)

    pending: list[list[_Group]] = [[] for _ in range(p)]  # posted, not done, in issue order
    pair_done: list[dict[int, float]] = [{} for _ in range(p)]  # peer -> when the rank's last group with it ended

    def settle() -> bool:
        """Activate and complete the groups that can; whether anything changed."""
        changed = False
        for r in range(p):
            for n, group in enumerate(pending[r]):
                if any(other.peers & group.peers for other in pending[r][:n]):
                    continue
                if group.active is None:
                    group.active = max([group.posted, *(pair_done[r].get(q, 0.0) for q in group.peers)])
                    changed = True
                for j, (t, (chan, k)) in enumerate(zip(group.post.transfers, group.slots)):
                    if j in group.finished:
                        continue
                    other = posted_on.get((*chan, not t.send), [])
                    if k >= len(other):
                        continue
                    peer_rank, peer_index = other[k]
                    peer_group = streams[peer_rank][peer_index]
                    if peer_group.active is None:
                        continue
                    group.finished[j] = max(group.active, peer_group.active) + p2p_cost
                    changed = True
                if len(group.finished) == len(group.post.transfers):
                    group.done = max([group.active, *group.finished.values()])
                    for q in group.peers:
                        pair_done[r][q] = group.done
                    changed = True
            pending[r] = [group for group in pending[r] if group.done is None]
        return changed

    def post(rank: int, item: Post) -> _Group:
        slots = []
        for t in item.transfers:
            chan = channel(rank, t)
            mine, theirs = messages.setdefault((*chan, t.send), []), messages.get((*chan, not t.send), [])
            k = len(mine)
            if k < len(theirs) and theirs[k] != t.message:
                sent, wanted = (t.message, theirs[k]) if t.send else (theirs[k], t.message)
                raise AssertionError(f"channel {chan} carries {sent} where rank {chan[1]} receives {wanted}: "
                                     "received out of the order it was sent")
            mine.append(t.message)
            posted_on.setdefault((*chan, t.send), []).append((rank, len(streams[rank])))
            slots.append((chan, k))
        group = _Group(item, clock[rank], slots, {t.peer for t in item.transfers})
        streams[rank].append(group)
        pending[rank].append(group)
        return group

    waiting: list[_Group | None] = [None] * p
    while any(position[r] < len(programs[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(programs[r]):
                item = programs[r][position[r]]
                if isinstance(item, Post):
                    if waiting[r] is None:
                        waiting[r] = post(r, item)
                        progressed = True
                        while settle():
                            pass
                    group = waiting[r]
                    if item.wait:
                        if group.done is None:
                            break
                        clock[r] = max(clock[r], group.done)
                    waiting[r] = None
                    position[r] += 1
                    progressed = True
                    continue
                g = global_stage(item.chunk, r, p)
                if item.kind == "B" and (g, item.microbatch) not in forwarded:
                    raise AssertionError(f"rank {r}: backward of micro-batch {item.microbatch} before its forward")
                cost = (f_cost if item.kind == "F" else b_cost)[g]
                clock[r] += cost
                busy[r] += cost
                if item.kind == "F":
                    forwarded.add((g, item.microbatch))
                live[r] += 1 if item.kind == "F" else -1
                most[r] = max(most[r], live[r])
                position[r] += 1
                progressed = True
        while settle():
            progressed = True
        if not progressed:
            stuck = {r: programs[r][position[r]] for r in range(p) if position[r] < len(programs[r])}
            raise AssertionError(f"the schedule deadlocks under NCCL semantics: ranks wait at {stuck}")
    while settle():
        pass
    unfinished = [r for r in range(p) if any(group.done is None for group in streams[r])]
    if unfinished:
        raise AssertionError(f"the schedule deadlocks under NCCL semantics: operations of ranks {unfinished} "
                             "never complete")
    ends = [max([clock[r], *(group.done for group in streams[r])]) for r in range(p)]
    return Simulation(busy, most, max(ends))
