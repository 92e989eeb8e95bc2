"""experiments/stability.py: the stated criteria (diverged: final training loss > 1 bit above its
minimum; stalled: final validation ppl not 10% below the unigram model's) and lr_max per seed, on
run logs built to fall on each side of them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import stability  # noqa: E402


def _run(root: Path, name: str, final_ppl: float, losses: list[float]) -> Path:
    run = root / name
    run.mkdir()
    lines = [f"x | INFO | train_inner | {json.dumps({'loss': str(x), 'num_updates': str(50 * (i + 1))})}"
             for i, x in enumerate(losses)]
    lines.append(f"x | INFO | valid | {json.dumps({'valid_ppl': str(final_ppl), 'valid_num_updates': '1000'})}")
    (run / "train.log").write_text("\n".join(lines) + "\n")
    return run


def test_outcomes_and_lr_max(tmp_path: Path, capsys) -> None:
    falling, rising = [11.0, 9.0, 8.5], [11.0, 8.0, 9.5]  # rising: 1.5 bits above its minimum
    runs = [
        _run(tmp_path, "st_postln_L6_lr1e-3_s1", 400.0, falling),
        _run(tmp_path, "st_postln_L6_lr2e-3_s1", 617.0, falling),   # just under 0.9 x 687 = 618.3: trains
        _run(tmp_path, "st_postln_L6_lr4e-3_s1", 619.0, falling),   # just over: stalled
        _run(tmp_path, "st_postln_L6_lr8e-3_s1", 300.0, rising),    # diverged, whatever its ppl
        _run(tmp_path, "st_postln_L6_lr1e-3_s2", 650.0, falling),
        _run(tmp_path, "st_postln_L6_lr2e-3_s2", 500.0, falling),
        _run(tmp_path, "st_deepnorm_L18_lr1e-3_s1", 700.0, falling),
    ]
    assert [stability.outcome(r, 687)[0] for r in runs[:4]] == ["trains", "trains", "stalled", "diverged"]
    assert stability.lr_max({1e-3: "trains", 2e-3: "trains", 4e-3: "stalled", 8e-3: "diverged"}) == 2e-3
    assert stability.lr_max({1e-3: "stalled"}) is None
    stability.main([str(r) for r in runs] + ["--unigram", "687", "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip() + line.split("|")[2].strip(): line for line in out.splitlines()
            if line.startswith("| ") and "backbone" not in line}
    assert rows["postln6"].rstrip().endswith("| 0.002 (0.002-0.002), 2/2 seeds |")
    assert "1/2 trains (1 stalled)" in rows["postln6"] and "0/1 trains (1 diverged)" in rows["postln6"]
    assert rows["deepnorm18"].rstrip().endswith("| - |")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_name_off_the_pattern_is_one_line(tmp_path: Path) -> None:
    run = _run(tmp_path, "st_postln_6_s1", 400.0, [9.0, 8.0])
    with pytest.raises(SystemExit, match="st_postln_6_s1: not named"):
        stability.main([str(run), "--unigram", "687"])


def test_outcome_mode_prints_one_word_per_run(tmp_path: Path, capsys) -> None:
    """What experiments/run.sh's stability_search reads to walk the learning-rate grid."""
    runs = [_run(tmp_path, "st_preln_L6_lr1e-3_s1", 600.0, [11.0, 9.0]),   # under 618.3: trains
            _run(tmp_path, "st_preln_L6_lr2e-3_s1", 640.0, [11.0, 9.0]),   # over: stalled
            _run(tmp_path, "st_preln_L6_lr4e-3_s1", 300.0, [11.0, 8.0, 9.5])]
    stability.main([str(r) for r in runs] + ["--unigram", "687", "--outcome"])
    assert capsys.readouterr().out.split() == ["trains", "stalled", "diverged"]


def test_a_report_from_records_equals_one_from_the_runs(tmp_path: Path, capsys) -> None:
    """--records: runs reported in two batches (two machines) give the table of all runs reported at once; a
    run given again replaces its record; a damaged records file is a one-line error naming the line."""
    falling = [11.0, 9.0, 8.5]
    first = [_run(tmp_path, "st_postln_L6_lr1e-3_s1", 400.0, falling),
             _run(tmp_path, "st_postln_L6_lr2e-3_s1", 640.0, falling)]
    second = [_run(tmp_path, "st_postln_L6_lr1e-3_s2", 500.0, falling),
              _run(tmp_path, "st_magneto_L18_lr4e-3_s1", 300.0, [11.0, 8.0, 9.5])]
    stability.main([str(r) for r in first + second] + ["--unigram", "687"])
    direct = capsys.readouterr().out
    records = tmp_path / "records" / "runs.jsonl"
    stability.main([str(r) for r in first] + ["--unigram", "687", "--records", str(records)])
    capsys.readouterr()
    stability.main([str(r) for r in second + first[:1]] + ["--unigram", "687", "--records", str(records)])
    assert capsys.readouterr().out == direct
    stability.main(["--unigram", "687", "--records", str(records)])
    assert capsys.readouterr().out == direct
    assert len(records.read_text().splitlines()) == 4
    kept = records.read_text()
    for damaged in ("not json", '{"run": "st_postln_L6_lr4e-3_s1", "ppl": 300.0}'):  # the second lacks 'diverged'
        records.write_text(kept + damaged + "\n")
        with pytest.raises(SystemExit, match=r"runs.jsonl:5: not a run record"):
            stability.main(["--unigram", "687", "--records", str(records)])
    with pytest.raises(SystemExit, match="no runs to report"):
        stability.main(["--unigram", "687", "--records", str(tmp_path / "none.jsonl")])


def test_plotted_lr_max_marks_the_grid_edges(tmp_path: Path) -> None:
    """Below the grid counts one x2 step under it (drawn v), a median at the top is '>=' (drawn ^)."""
    lrs = [5e-4, 1e-3, 2e-3, 4e-3]
    assert stability.plotted_point([None, None, 2e-3], lrs) == (2.5e-4, 2.5e-4, 2e-3, "v")
    assert stability.plotted_point([2e-3, 4e-3, 2e-3], lrs) == (2e-3, 2e-3, 4e-3, "o")
    assert stability.plotted_point([4e-3, 4e-3, 1e-3], lrs) == (4e-3, 1e-3, 4e-3, "^")
    out = tmp_path / "lr_max.png"
    stability.plot_lr_max({"postln": {6: [2e-3], 18: [None]}, "magneto": {6: [4e-3], 18: [4e-3]}}, lrs, out)
    assert out.read_bytes()[:4] == b"\x89PNG"
