"""The figure of ``docs/parallelism.md``: the rank grid and every process group of one layout, and a
1F1B timeline with the point-to-point batches each stage posts between its steps.

    python experiments/parallelism_diagram.py                      # the figure in docs/parallelism.md
    python experiments/parallelism_diagram.py --world 64 --tensor 8 --pipeline 2 --expert-parallel 4

The grid is drawn from the rank formula alone, ``global rank = t + T (d + D p)`` (tensor position
``t``, data-parallel position ``d``, pipeline stage ``p``; ``D = W / (T P)``), and every group is
read off the drawing: a row of a stage's table is a tensor-parallel group, a column a data-parallel
group, a cell across the stages a pipeline; experts are spread over all-to-all groups of ``A``
consecutive data-parallel positions and replicated at the same position of every such group. No
function of the package computes them here (``tests/experiments/test_parallelism_diagram.py``
holds the drawing against the package's ``parallel_groups_layout``).

The timeline runs the package's own 1F1B step order (``schedule_steps``) with a forward costing one
unit and a backward two; the batches under it are the target design of issue 44 item 4: between
two steps a stage posts the send of the step it finished and the receive of the step it starts
next together, as one ``torch.distributed.batch_isend_irecv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchscale_fairseq.model_parallel.pipeline_schedules import Step, schedule_steps  # noqa: E402

Groups = dict[str, list[list[int]]]


def rank_grid(world: int, tensor: int, pipeline: int) -> list[list[list[int]]]:
    """``grid[p][d][t]`` = the global rank ``t + T (d + D p)``."""
    if world % (tensor * pipeline):
        raise SystemExit(f"--tensor {tensor} x --pipeline {pipeline} does not divide --world {world}: "
                         "choose sizes whose product divides the world size")
    data = world // (tensor * pipeline)
    return [[[t + tensor * (d + data * p) for t in range(tensor)] for d in range(data)] for p in range(pipeline)]


def groups_of(grid: list[list[list[int]]], expert_parallel: int) -> Groups:
    """Every group, read off the grid (rows, columns, cells across stages)."""
    pipeline, data, tensor = len(grid), len(grid[0]), len(grid[0][0])
    pipelines = [[grid[p][d][t] for p in range(pipeline)] for d in range(data) for t in range(tensor)]
    columns = [[grid[p][d][t] for d in range(data)] for p in range(pipeline) for t in range(tensor)]
    groups: Groups = {
        "tensor": [row for stage in grid for row in stage],
        "data": columns,
        "pipeline": pipelines,
        "embedding": [[ranks[0], ranks[-1]] if pipeline > 1 else ranks for ranks in pipelines],
    }
    if expert_parallel:
        a = expert_parallel
        if data % a:
            raise SystemExit(f"--expert-parallel {a} does not divide the {data} data-parallel ranks: choose a divisor")
        groups["expert all-to-all"] = [column[i: i + a] for column in columns for i in range(0, data, a)]
        groups["expert replicas"] = [column[j::a] for column in columns for j in range(a)]
    return groups


def grid_text(grid: list[list[list[int]]]) -> list[str]:
    """One table per stage, side by side: rows ``d``, columns ``t``."""
    tensor = len(grid[0][0])
    width = max(len(str(r)) for stage in grid for row in stage for r in row) + 2
    tables = []
    for p, stage in enumerate(grid):
        lines = [f"stage p = {p}", "       " + "".join(f"t={t}".rjust(width) for t in range(tensor))]
        lines += [f"d = {d:<3}" + "".join(str(r).rjust(width) for r in row) for d, row in enumerate(stage)]
        tables.append(lines)
    column = max(len(line) for table in tables for line in table) + 4
    return ["".join(table[i].ljust(column) for table in tables).rstrip() for i in range(len(tables[0]))]


def timeline(steps: list[list[Step]], forward: int = 1, backward: int = 2) -> tuple[list[list[int]], list[int]]:
    """Start times and the makespan of every stage's steps (a step starts when its stage is free
    and its input has arrived)."""
    stages = len(steps)
    done: dict[tuple[str, int, int], int] = {}
    position, clock = [0] * stages, [0] * stages
    starts: list[list[int]] = [[] for _ in range(stages)]
    while any(position[s] < len(steps[s]) for s in range(stages)):
        for s in range(stages):
            if position[s] == len(steps[s]):
                continue
            step = steps[s][position[s]]
            source = s - 1 if step.kind == "F" else s + 1
            ready = clock[s]
            if 0 <= source < stages:
                if (step.kind, source, step.microbatch) not in done:
                    continue
                ready = max(ready, done[step.kind, source, step.microbatch])
            starts[s].append(ready)
            clock[s] = ready + (forward if step.kind == "F" else backward)
            done[step.kind, s, step.microbatch] = clock[s]
            position[s] += 1
    return starts, clock


def p2p_batches(steps: list[Step], stage: int, stages: int) -> list[list[str]]:
    """What ``stage`` posts before its first step, between two steps and after its last:
    ``<a i`` / ``>a i`` receive / send the activation of micro-batch ``i`` (from the stage
    before / to the stage after), ``<g i`` / ``>g i`` the gradient (from after / to before)."""

    def receive(step: Step) -> list[str]:
        if step.kind == "F":
            return [f"<a{step.microbatch}"] if stage > 0 else []
        return [f"<g{step.microbatch}"] if stage < stages - 1 else []

    def send(step: Step) -> list[str]:
        if step.kind == "F":
            return [f">a{step.microbatch}"] if stage < stages - 1 else []
        return [f">g{step.microbatch}"] if stage > 0 else []

    batches = [receive(steps[0])]
    batches += [send(done) + receive(following) for done, following in zip(steps, steps[1:])]
    return batches + [send(steps[-1])]


def timeline_text(stages: int, microbatches: int) -> list[str]:
    steps = [schedule_steps("1f1b", stages, s, microbatches) for s in range(stages)]
    starts, clock = timeline(steps)
    makespan = max(clock)
    lines = [f"1F1B, P = {stages}, m = {microbatches}: two columns = one unit (forward Fi: 1 unit, backward Bi--: 2; "
             ".. idle)",
             "time      " + " ".join(str(u % 10) for u in range(makespan))]
    for s in range(stages):
        row = [".."] * makespan
        for step, start in zip(steps[s], starts[s]):
            if step.kind == "F":
                row[start] = f"F{step.microbatch}"
            else:
                row[start: start + 2] = [f"B{step.microbatch}", "--"]
        lines.append(f"stage {s}   " + "".join(row))
    lines.append("")
    lines.append("batches each stage posts (one batch_isend_irecv between two steps; <a receive an activation,")
    lines.append(">a send one, <g receive a gradient, >g send one; - nothing to post):")
    for s in range(stages):
        posted = " ".join("{" + " ".join(b) + "}" if b else "-" for b in p2p_batches(steps[s], s, stages))
        lines.append(f"stage {s}   {posted}")
    return lines


def diagram(world: int, tensor: int, pipeline: int, expert_parallel: int, stages: int, microbatches: int) -> str:
    grid = rank_grid(world, tensor, pipeline)
    data = world // (tensor * pipeline)
    lines = [f"W = {world}, T = {tensor}, P = {pipeline}, D = {data}: global rank = t + T (d + D p)", ""]
    lines += grid_text(grid)
    lines.append("")
    groups = groups_of(grid, expert_parallel)
    what = {"tensor": "a row", "data": "a column", "pipeline": "a cell in every stage",
            "embedding": "first and last stage of a pipeline",
            "expert all-to-all": f"A = {expert_parallel} consecutive ranks of a column, E / A of the E experts each",
            "expert replicas": "the same place in every all-to-all group of a column"}
    for name, ranks in groups.items():
        lines.append(f"{name} ({what[name]}):")
        lines.append("    " + " ".join("[" + ",".join(map(str, r)) + "]" for r in ranks))
    lines.append("")
    lines += timeline_text(stages, microbatches)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=16)
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--pipeline", type=int, default=2)
    parser.add_argument("--expert-parallel", type=int, default=2, help="A, the all-to-all group size (0: none)")
    parser.add_argument("--timeline-stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    sys.stdout.write(diagram(args.world, args.tensor, args.pipeline, args.expert_parallel, args.timeline_stages,
                             args.microbatches))


if __name__ == "__main__":
    main()
