"""experiments/parallelism_diagram.py: the groups read off its drawing are the package's
(``parallel_groups_layout``; the expert groups by the rule of ``model_parallel/expert_parallel.py``
over the package's data-parallel groups), its 1F1B timeline takes ``(m + P - 1)(f + b)``, the
batches it lists pair every send with a receive in channel order, and docs/parallelism.md shows its
current output."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from torchscale_fairseq.model_parallel.parallel_context import parallel_groups_layout

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import parallelism_diagram  # noqa: E402

LAYOUTS = [(16, 2, 2, 2), (8, 1, 4, 2), (24, 2, 3, 4), (32, 4, 2, 1), (16, 2, 1, 8)]  # W, T, P, A


def drawn_grid(text: str) -> list[list[list[int]]]:
    """``grid[p][d][t]`` as the tables of the drawing show it."""
    grid: list[list[list[int]]] = []
    for line in text.splitlines():
        if not line.startswith("d = "):
            continue
        for p, cell in enumerate(re.split(r"\s*d = ", line)[1:]):
            d, *ranks = (int(x) for x in cell.split())
            if p == len(grid):
                grid.append([])
            assert d == len(grid[p])
            grid[p].append(ranks)
    return grid


def listed_groups(text: str) -> dict[str, set[tuple[int, ...]]]:
    return {name: {tuple(int(r) for r in ranks.split(",")) for ranks in re.findall(r"\[([\d,]+)\]", listed)}
            for name, listed in re.findall(r"^(\w[\w -]*?) \(.*\):\n +(.*)$", text, re.M)}


@pytest.mark.parametrize("world,tensor,pipeline,a2a", LAYOUTS)
def test_drawn_groups_are_the_packages(world: int, tensor: int, pipeline: int, a2a: int) -> None:
    text = parallelism_diagram.diagram(world, tensor, pipeline, a2a, stages=2, microbatches=2)
    layout = parallel_groups_layout(world, tensor, pipeline)

    def as_set(groups: list[list[int]]) -> set[tuple[int, ...]]:
        return {tuple(g) for g in groups}

    grid = drawn_grid(text)
    assert sorted(r for stage in grid for row in stage for r in row) == list(range(world))
    assert as_set([row for stage in grid for row in stage]) == as_set(layout.tensor)
    assert as_set([[row[t] for row in stage] for stage in grid for t in range(tensor)]) == as_set(layout.data)
    assert as_set([[stage[d][t] for stage in grid] for d in range(len(grid[0])) for t in range(tensor)]) == \
        as_set(layout.pipeline)
    listed = listed_groups(text)
    assert listed["tensor"] == as_set(layout.tensor)
    assert listed["data"] == as_set(layout.data)
    assert listed["pipeline"] == as_set(layout.pipeline)
    assert listed["embedding"] == as_set(layout.embedding)
    data = len(layout.data[0])
    assert listed["expert all-to-all"] == {tuple(g[i: i + a2a]) for g in layout.data for i in range(0, data, a2a)}
    assert listed["expert replicas"] == {tuple(g[j::a2a]) for g in layout.data for j in range(a2a)}


@pytest.mark.parametrize("stages,microbatches", [(4, 8), (2, 5), (3, 3), (5, 2)])
def test_timeline_and_batches(stages: int, microbatches: int) -> None:
    lines = parallelism_diagram.timeline_text(stages, microbatches)
    units = len(lines[1].split()) - 1  # "time 0 1 2 ..."
    assert units == (microbatches + stages - 1) * (1 + 2)  # (m + P - 1)(f + b), f = 1, b = 2
    posted = {int(m.group(1)): m.group(2) for line in lines if (m := re.match(r"stage (\d+) +(.*\{.*)$", line))}
    ops = {s: re.findall(r"([<>][ag])(\d+)", text) for s, text in posted.items()}
    for s in range(stages - 1):  # the channel s -> s + 1 carries activations, s + 1 -> s gradients
        assert [i for op, i in ops[s] if op == ">a"] == [i for op, i in ops[s + 1] if op == "<a"]
        assert [i for op, i in ops[s + 1] if op == ">g"] == [i for op, i in ops[s] if op == "<g"]
    for s in range(stages):
        assert sorted(i for op, i in ops[s] if op == ">a") == ([] if s == stages - 1 else
                                                                sorted(map(str, range(microbatches))))


def test_docs_show_the_current_output() -> None:
    doc = (REPO / "docs" / "parallelism.md").read_text()
    block = re.search(r"<!-- python experiments/parallelism_diagram.py -->\n```text\n(.*?)```\n", doc, re.S)
    assert block is not None, "docs/parallelism.md lost its diagram block"
    assert block.group(1) == parallelism_diagram.diagram(16, 2, 2, 2, 4, 8)
