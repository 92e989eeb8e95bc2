"""experiments/grad_norm_scaling.py: the expert / dense gradient-norm ratio per expert count from
fairseq's logged ``gnorm_expert`` / ``gnorm_dense``, and its power-law fit, on logs built from a
known law."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import grad_norm_scaling  # noqa: E402


def _run(root: Path, name: str, ratios: list[float]) -> Path:
    run = root / name
    run.mkdir()
    records = [{"num_updates": str(i + 1), "gnorm_dense": "2.0", "gnorm_expert": str(2.0 * r)} for i, r in enumerate(ratios)]
    (run / "train.log").write_text("".join(f"x | INFO | train_inner | {json.dumps(r)}\n" for r in records))
    return run


def test_ratios_fit_and_share(tmp_path: Path, capsys) -> None:
    law = {8: 0.3, 32: 0.6, 128: 1.2}  # r = 0.3 (E/8)^0.5: c = 0.3 / sqrt(8), alpha = 0.5
    runs = []
    for e, r in law.items():
        for seed in (1, 2):
            runs.append(_run(tmp_path, f"cs_E{e}_s{seed}", [r * 2] * 10 + [r] * 15))  # early 2r, late r
    assert grad_norm_scaling.ratios(grad_norm_scaling.run_records(runs[0]), "cs") == pytest.approx((0.6, 0.3))
    c, alpha = grad_norm_scaling.fit_power_law([(e, r) for e, r in law.items()])
    assert alpha == pytest.approx(0.5) and c == pytest.approx(0.3 / math.sqrt(8))
    assert grad_norm_scaling.expert_share(2.0, 4) == pytest.approx(0.5)  # kappa r = 1: half of the norm^2
    grad_norm_scaling.main([str(r) for r in runs] + ["--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert "| 128 | 2 | 2.400 ± 0.000 (2.400-2.400) | 1.200 ± 0.000 (1.200-1.200) |" in out
    assert "fit, late: r = 0.106 * E^0.500" in out and "fit, early: r = 0.212 * E^0.500" in out
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_too_few_updates_is_one_line(tmp_path: Path) -> None:
    run = _run(tmp_path, "cs_E8_s1", [0.5] * 5)
    with pytest.raises(SystemExit, match="5 updates with gnorm_dense/gnorm_expert, need 20"):
        grad_norm_scaling.ratios(grad_norm_scaling.run_records(run), run.name)


def test_the_committed_table_follows_from_its_committed_runs(capsys) -> None:
    """docs/results.md section 8: the table in docs/results/clip/norm_ratio_vs_experts.md is what the runs in
    norm_ratio_runs.jsonl (every update's logged norms) give."""
    results = REPO / "docs" / "results" / "clip"
    grad_norm_scaling.main(["--records", str(results / "norm_ratio_runs.jsonl")])
    assert capsys.readouterr().out == (results / "norm_ratio_vs_experts.md").read_text()


def test_runs_come_from_directories_or_records_not_both(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        grad_norm_scaling.main([])
    with pytest.raises(SystemExit):
        grad_norm_scaling.main([str(_run(tmp_path, "cs_E8_s1", [1.0] * 20)), "--records", str(tmp_path / "r.jsonl")])
