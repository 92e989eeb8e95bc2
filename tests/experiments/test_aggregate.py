"""experiments/aggregate.py: seeds grouped by configuration, mean ± sample std (min-max) per column."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import aggregate  # noqa: E402


def _run(root: Path, name: str, ppls: list[float], losses: list[float]) -> Path:
    """A run directory whose train.log holds fairseq JSON records, as fairseq-train writes them."""
    run = root / name
    run.mkdir()
    lines = [f"2026-11-23 | INFO | train_inner | {json.dumps({'loss': str(x), 'num_updates': str(10 * (i + 1))})}"
             for i, x in enumerate(losses)]
    lines += [f"2026-11-23 | INFO | valid | {json.dumps({'valid_ppl': str(p), 'valid_num_updates': str(20 * (i + 1))})}"
              for i, p in enumerate(ppls)]
    (run / "train.log").write_text("\n".join(lines) + "\n")
    return run


def test_table_is_mean_std_min_max_over_seeds(tmp_path: Path) -> None:
    finals = [100.0, 130.0, 115.0]
    runs = [_run(tmp_path, f"deep_s{seed}", [400.0, p], [9.0, 8.0]) for seed, p in zip((1, 2, 3), finals)]
    runs.append(_run(tmp_path, "shallow_s1", [500.0, 300.0], [9.0, 10.5]))
    groups = aggregate.group_runs(runs)
    assert list(groups) == ["deep", "shallow"] and len(groups["deep"]) == 3
    lines = aggregate.table(groups)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    deep = dict(zip(header, (c.strip() for c in lines[2].strip("|").split("|"))))
    mean, std = statistics.fmean(finals), statistics.stdev(finals)
    assert deep["valid ppl final"] == f"{mean:.1f} ± {std:.1f} (100.0-130.0)"
    assert deep["valid ppl best"] == deep["valid ppl final"] and deep["seeds"] == "3"
    shallow = dict(zip(header, (c.strip() for c in lines[3].strip("|").split("|"))))
    assert shallow["diverged"] == "1/1" and deep["diverged"] == "0/3"  # final loss > 1 bit above its minimum


def test_plot_draws_every_config(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runs = [_run(tmp_path, f"c_s{seed}", [200.0 + seed, 150.0], [9.0, 8.0]) for seed in (1, 2)]
    out = tmp_path / "plots" / "valid_ppl.png"
    assert aggregate.plot(aggregate.group_runs(runs), "valid_ppl", out)
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert not aggregate.plot(aggregate.group_runs(runs), "moe_entropy", tmp_path / "none.png")


def test_loss_spikes_and_norm_ratio_columns(tmp_path: Path) -> None:
    """A spike is a loss > 0.5 bit above the median of the 10 before it; the ratio is the mean of expert / dense."""
    import summarize

    losses = [6.0] * 12 + [6.6] + [6.0] * 11 + [6.4] + [5.9] * 10 + [6.55]  # spikes: 6.6 and 6.55 (> 5.9 + 0.5)
    assert summarize.loss_spikes(losses) == 2
    assert summarize.loss_spikes([9.0 - 0.1 * i for i in range(30)]) == 0  # a falling loss has none
    run = tmp_path / "clip_s1"
    run.mkdir()
    parts = [(0.2, 1.0), (0.1, 0.5), (0.3, 0.5)]  # (expert, dense): ratios 0.2, 0.2, 0.6
    records = [{"loss": str(x), "num_updates": str(i + 1), "gnorm_expert": str(parts[i % 3][0]),
                "gnorm_dense": str(parts[i % 3][1])} for i, x in enumerate(losses[:30])]
    (run / "train.log").write_text("".join(f"2026-11-28 | INFO | train_inner | {json.dumps(r)}\n" for r in records))
    lines = aggregate.table(aggregate.group_runs([run]))
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    row = dict(zip(header, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert row["loss spikes"] == "1"  # the first 30 losses hold the 6.6 only
    assert row["expert / dense norm"] == f"{(0.2 + 0.2 + 0.6) / 3:.3f}"


def test_distinct_hypotheses_column(tmp_path: Path) -> None:
    """The fraction of distinct H- lines of generate_test.txt: 2 distinct of 4 is 0.5 (scores and ids ignored)."""
    runs = [_run(tmp_path, f"nmt_s{seed}", [100.0], [8.0]) for seed in (1, 2)]
    (runs[0] / "generate_test.txt").write_text(
        "S-0\tA\nH-0\t-1.5\t▁Y ▁los\nH-1\t-1.2\t▁Y ▁los\nH-2\t-0.5\t▁El\nH-3\t-0.7\t▁Y ▁los\nD-0\t-1.5\tY los\n")
    (runs[1] / "generate_test.txt").write_text("H-0\t-1.0\t▁a\nH-1\t-1.0\t▁b\n")  # every one distinct: 1.0
    lines = aggregate.table(aggregate.group_runs(runs))
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    row = dict(zip(header, (c.strip() for c in lines[2].strip("|").split("|"))))
    mean, std = statistics.fmean([0.5, 1.0]), statistics.stdev([0.5, 1.0])
    assert row["distinct hypotheses"] == f"{mean:.3f} ± {std:.3f} (0.500-1.000)"


def test_runs_jsonl_holds_every_validation_and_interval(tmp_path: Path) -> None:
    """--runs-jsonl: one line per run with the logged validations and intervals as written, and the table's numbers."""
    runs = [_run(tmp_path, f"deep_s{seed}", [400.0 + seed, 100.0 + seed], [9.0, 8.5, 8.0 + seed / 10])
            for seed in (1, 2)]
    extra = runs[1] / "train.log"
    extra.write_text(extra.read_text() + "2026-11-23 | INFO | train_inner | " + json.dumps(
        {"loss": "7.9", "num_updates": "40", "gnorm": "0.5", "gnorm_dense": "0.4", "gnorm_expert": "0.3", "clip": "100",
         "lr": "0.001", "wps": "123"}) + "\n")
    out = tmp_path / "out" / "runs.jsonl"
    aggregate.main([*map(str, runs), "--runs-jsonl", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["run"], r["config"], r["seed"]) for r in lines] == [("deep_s1", "deep", 1), ("deep_s2", "deep", 2)]
    assert lines[0]["valid"] == [{"update": 20, "ppl": 401.0}, {"update": 40, "ppl": 101.0}]
    assert lines[0]["train"] == [{"update": 10, "loss": 9.0}, {"update": 20, "loss": 8.5}, {"update": 30, "loss": 8.1}]
    assert lines[1]["train"][-1] == {"update": 40, "loss": 7.9, "gnorm": 0.5, "gnorm_dense": 0.4, "gnorm_expert": 0.3,
                                     "clip": 100.0, "lr": 0.001}  # the listed keys only (no wps)
    assert lines[1]["ppl_final"] == 102.0 and lines[1]["loss_final"] == 7.9 and lines[1]["gnorm_max"] == 0.5
    assert "test_outputs" not in lines[0]


def test_runs_jsonl_counts_the_test_outputs(tmp_path: Path) -> None:
    """With generate_test.txt: the outputs as fairseq-generate wrote them (D- lines) counted, distinct, the commonest three."""
    run = _run(tmp_path, "nmt_s1", [100.0], [8.0])
    (run / "generate_test.txt").write_text("".join(
        f"S-{i}\tsrc\nH-{i}\t-1.0\t▁x\nD-{i}\t-1.0\t{text}\n"
        for i, text in enumerate(["Y dijo:", "Y dijo:", "El rey.", "Y dijo:", "de , ,", "El rey."])))
    out = tmp_path / "runs.jsonl"
    aggregate.main([str(run), "--runs-jsonl", str(out)])
    outputs = json.loads(out.read_text())["test_outputs"]
    assert outputs == {"count": 6, "distinct": 3, "commonest": [["Y dijo:", 3], ["El rey.", 2], ["de , ,", 1]]}


def test_runs_jsonl_is_strict_json_with_the_moe_columns(tmp_path: Path) -> None:
    """A non-finite loss is null (the run flagged nonfinite), a name without a seed has seed null, and
    --moe adds the load CV and dropped fraction: the mean over the layers of the last records."""
    run = tmp_path / "blowup"
    run.mkdir()
    records = [{"loss": "9.0", "num_updates": "1", "moe_cv_dec1": "0.2", "moe_cv_dec3": "0.4", "moe_drop": "0.1"},
               {"loss": "inf", "num_updates": "2", "moe_cv_dec1": "0.3", "moe_cv_dec3": "0.5", "moe_drop": "0.3"}]
    valid = {"valid_ppl": "500", "valid_num_updates": "2", "valid_moe_cv_dec1": "0.1", "valid_moe_cv_dec3": "0.3"}
    (run / "train.log").write_text("".join(f"x | INFO | train_inner | {json.dumps(r)}\n" for r in records)
                                   + f"x | INFO | valid | {json.dumps(valid)}\n")
    out = tmp_path / "runs.jsonl"
    aggregate.main([str(run), "--moe", "--runs-jsonl", str(out)])

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in runs.jsonl")

    line = json.loads(out.read_text(), parse_constant=refuse)
    assert line["seed"] is None and line["config"] == "blowup" and line["nonfinite"] is True
    assert line["loss_final"] is None and line["train"][1] == {"update": 2, "loss": None}
    assert line["cv_valid"] == pytest.approx(0.2) and line["cv_train"] == pytest.approx(0.4)
    assert line["drop_train"] == pytest.approx(0.3) and line["drop_mean"] == pytest.approx(0.2)


def test_runs_jsonl_merge_keeps_other_runs_and_replaces_the_given(tmp_path: Path) -> None:
    """--merge: the file's lines of runs not given stay (runs made elsewhere), a run given again is replaced."""
    out = tmp_path / "runs.jsonl"
    first = [_run(tmp_path, f"deep_s{seed}", [400.0 + seed], [9.0]) for seed in (1, 2)]
    aggregate.main([*map(str, first), "--runs-jsonl", str(out)])
    again = tmp_path / "again"
    again.mkdir()
    second = [_run(again, f"deep_s{seed}", [300.0 + seed], [8.0]) for seed in (2, 3)]
    aggregate.main([*map(str, second), "--runs-jsonl", str(out), "--merge"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["run"], r["ppl_final"]) for r in lines] == [("deep_s1", 401.0), ("deep_s2", 302.0), ("deep_s3", 303.0)]
    aggregate.main([*map(str, second), "--runs-jsonl", str(out)])  # without --merge: the runs given only
    assert [json.loads(line)["run"] for line in out.read_text().splitlines()] == ["deep_s2", "deep_s3"]
