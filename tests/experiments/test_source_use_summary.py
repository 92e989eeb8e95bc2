"""experiments/source_use_summary.py: its cells are the mean (min-max) / mean ± std over seeds of the rows, computed
here with ``statistics``; the outcome follows the 10%-below-the-unigram criterion; bad records are one-line errors."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import source_use_summary  # noqa: E402

# (backbone, seed): spread at init, (update, spread, ppl, ppl shuffled) on 300 verses, final (ppl, shuffled, spread)
RUNS = {
    ("deepnorm", 1): (0.9, [(50, 0.5, 900.0, 901.0), (100, 0.001, 500.0, 500.0)], (420.0, 420.0, 0.002)),
    ("deepnorm", 2): (0.8, [(50, 0.3, 800.0, 800.0), (100, 0.003, 400.0, 400.0)], (400.0, 400.4, 0.004)),
    ("magneto", 1): (0.7, [(50, 0.2, 700.0, 714.0), (100, 0.4, 300.0, 330.0)], (310.0, 341.0, 0.41)),
}


def write_records(path: Path) -> Path:
    rows = []
    for (backbone, seed), (init, curve, (ppl, shuffled, spread)) in RUNS.items():
        run = f"nmtwarm_{backbone}_s{seed}"
        common = {"run": run, "backbone": backbone, "seed": seed, "lr": 5e-4}
        rows += [{**common, "checkpoint": f"checkpoint_1_{u}.pt", "update": u, "verses": 300, "ppl": p,
                  "ppl_shuffled": q, "spread": s, "spread_init": init} for u, s, p, q in curve]
        rows.append({**common, "checkpoint": "checkpoint_last.pt", "update": 100, "verses": 1500, "ppl": ppl,
                     "ppl_shuffled": shuffled, "spread": spread})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def table_row(lines: list[str], title: str, backbone: str) -> list[str]:
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    row = next(line for line in lines[start:] if line.startswith(f"| {backbone} |"))
    return row.strip("| ").split(" | ")[1:]


def test_curves_and_finals_are_the_seed_statistics(tmp_path: Path, capsys) -> None:
    source_use_summary.main([str(write_records(tmp_path / "rows.jsonl")), "--unigram", "461.8",
                             "--plot", str(tmp_path / "spread.png")])
    lines = capsys.readouterr().out.splitlines()
    assert (tmp_path / "spread.png").stat().st_size > 0
    spreads = table_row(lines, "encoder spread", "deepnorm")  # updates 0 (init), 50, 100
    for cell, values in zip(spreads, ([0.9, 0.8], [0.5, 0.3], [0.001, 0.003])):
        assert cell == (f"{statistics.fmean(values):.2g} ({min(values):.2g}-{max(values):.2g})")
    ratios = table_row(lines, "shuffled / real ppl", "magneto")
    assert ratios == ["-", f"{714 / 700:.3f}", f"{330 / 300:.3f}"]  # no ppl at init
    final = table_row(lines, "final row", "deepnorm")
    assert final[:3] == ["2", "1500", "100"]
    ppls = [420.0, 400.0]
    assert final[3] == (f"{statistics.fmean(ppls):.1f} ± {statistics.stdev(ppls):.1f} (400.0-420.0)")
    # 0.9 x 461.8 = 415.62: 420 stalls, 400 trains
    assert final[4] == "stalled 1/2, trains 1/2"
    assert final[5] == f"{statistics.fmean([1.0, 1.001]):.3f} (1.000-1.001)"
    assert final[8] == "0.001 (100), 0.003 (100)"  # each seed's smallest spread and its update
    magneto = table_row(lines, "final row", "magneto")
    assert magneto[4] == "trains 1/1" and magneto[8] == "0.2 (50)"


def test_bad_records_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no records file .*missing.jsonl"):
        source_use_summary.main([str(tmp_path / "missing.jsonl"), "--unigram", "461.8"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"run": "x"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1: not a source_use.py row"):
        source_use_summary.main([str(bad), "--unigram", "461.8"])
    bad.write_text("")
    with pytest.raises(SystemExit, match="no rows"):
        source_use_summary.main([str(bad), "--unigram", "461.8"])
