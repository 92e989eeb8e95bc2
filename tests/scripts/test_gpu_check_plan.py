"""``scripts/gpu/run_gpu_check.sh`` without a GPU or a wheelhouse: ``--plan`` checks that every stage
fits one device call (570 s), that its steps' expected times fit its limit and that all stages fit
25 minutes (an estimate over its stage's limit fails); ``--next`` resumes from the results that
earlier runs wrote (a step that ran is done, one skipped for the budget or not run is not, one that
reported "no CUDA" is done only while there is still no CUDA)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu" / "run_gpu_check.sh"
STAGE_1 = ("cpu-smoke", "pytest-gpu", "bench-moe", "bench-moe-compile")


def check(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "OUT"}
    base.update({"PYTHON": sys.executable, **env})
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=base, timeout=600)


def test_plan_fits_the_device_calls():
    proc = check("--plan")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stages = re.findall(r"^stage (\d): limit +(\d+)s, expected +(\d+)s$", proc.stdout, re.M)
    assert [s for s, _, _ in stages] == ["1", "2", "3"]
    for _, limit, expected in stages:
        assert int(expected) <= int(limit) <= 570
    assert sum(int(limit) for _, limit, _ in stages) <= 25 * 60


def test_plan_refuses_a_stage_over_its_limit():
    proc = check("--plan", GPU_CHECK_EXPECTED="bench-speed=530")
    assert proc.returncode == 1
    assert re.search(r"^plan error: stage 3 expects \d+s, over its 560s limit", proc.stdout, re.M), proc.stdout


def write_stage(results: Path, stage: int, statuses: dict[str, str]) -> None:
    rows = "\n".join(f"| {step} | {status} | 1 | - |" for step, status in statuses.items())
    (results / f"stage{stage}.md").write_text(f"# GPU check, stage {stage}\n\n| step | status | seconds | result |\n"
                                             f"|---|---|---|---|\n| install | ok | 40 | - |\n{rows}\n")


def test_next_resumes_where_the_results_stop(tmp_path):
    """Without CUDA, then on a GPU (the script's ``python3`` a stand-in whose torch says which: the
    plan alone is under test, and importing the real torch once per call is most of its time)."""
    results = tmp_path / "results"
    results.mkdir()
    no_cuda, cuda = fake_python(tmp_path / "cpu", cuda=False), fake_python(tmp_path / "gpu", cuda=True)

    def next_stage(python: Path = no_cuda) -> str:
        proc = check("--next", GPU_CHECK_RESULTS=str(results), PYTHON=str(python))
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert next_stage() == "1"
    write_stage(results, 1, {"cpu-smoke": "ok", "pytest-gpu": "FAILED (exit 1)", "bench-moe": "SKIPPED (stage budget spent)",
                             "bench-moe-compile": "ok"})
    assert next_stage() == "1"
    write_stage(results, 1, {"cpu-smoke": "ok", "pytest-gpu": "FAILED (exit 1)", "bench-moe": "no CUDA",
                             "bench-moe-compile": "no CUDA"})
    assert next_stage() == "2"
    write_stage(results, 2, {"pytest-gpu-training": "TIMEOUT after 360s", "bench-generation": "ok"})
    write_stage(results, 3, {"bench-speed": "not run (install failed)"})
    assert next_stage() == "3"
    write_stage(results, 3, {"bench-speed": "ok"})
    assert next_stage() == "none"
    assert next_stage(cuda) == "1"  # what ran without CUDA is to do again where there is CUDA
    write_stage(results, 1, dict.fromkeys(STAGE_1, "ok"))
    assert next_stage(cuda) == "none"


def fake_python(tmp_path: Path, cuda: bool) -> Path:
    """A ``python3`` for the script whose torch says whether CUDA is available."""
    fake = tmp_path / "fake_torch"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(f"class cuda:\n    is_available = staticmethod(lambda: {cuda})\n")
    exe = tmp_path / "python3"
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} \"$@\"\n")
    exe.chmod(0o755)
    return exe
