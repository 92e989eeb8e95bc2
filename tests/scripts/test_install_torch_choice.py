"""``scripts/install.sh`` picks the PyTorch build (``INSTALL_DRY_RUN=1`` prints the decision
and stops before touching any environment): CUDA where ``nvidia-smi`` runs, CPU otherwise,
the CPU index only when it answers, and every choice overridable."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def decision(tmp_path: Path, smi_exit: int | None, **env: str) -> subprocess.CompletedProcess:
    """Run the dry install with a fake ``nvidia-smi`` exiting ``smi_exit`` (None: none on PATH)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    path = os.environ["PATH"]
    if smi_exit is not None:
        smi = bindir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nexit {smi_exit}\n")
        smi.chmod(0o755)
        path = f"{bindir}:{path}"
    else:  # hide a real nvidia-smi, keep bash and python3
        path = ":".join(p for p in path.split(":") if not (Path(p) / "nvidia-smi").exists())
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_BUILD", "TORCH_INDEX_URL", "TORCH_SPEC")}
    base.update({"PATH": path, "INSTALL_DRY_RUN": "1", "VENV": str(tmp_path / "venv"),
                 "TORCH_CPU_INDEX": f"file://{tmp_path / 'no-such-index'}", **env})
    return subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], capture_output=True, text=True, env=base,
                          timeout=60)


def line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_no_driver_gives_cpu_build_plain_spec_when_cpu_index_unreachable(tmp_path):
    assert line(decision(tmp_path, None)) == "[install] torch: build cpu, pip install torch==2.13.0"
    assert not (tmp_path / "venv").exists()  # the dry run creates nothing


def test_failing_nvidia_smi_is_no_driver(tmp_path):
    assert "build cpu" in line(decision(tmp_path, 9))


def test_cpu_index_used_when_it_answers(tmp_path):
    index = tmp_path / "cpu-index"
    index.write_text("<html></html>")
    out = line(decision(tmp_path, None, TORCH_CPU_INDEX=f"file://{index}"))
    assert out == f"[install] torch: build cpu, pip install torch==2.13.0 --index-url file://{index}"


def test_driver_gives_cuda_build_from_plain_spec(tmp_path):
    index = tmp_path / "cpu-index"
    index.write_text("<html></html>")  # reachable, but not for a CUDA build
    out = line(decision(tmp_path, 0, TORCH_CPU_INDEX=f"file://{index}"))
    assert out == "[install] torch: build cuda, pip install torch==2.13.0"


@pytest.mark.parametrize("smi_exit", [None, 0])
def test_overrides(tmp_path, smi_exit):
    out = line(decision(tmp_path, smi_exit, TORCH_BUILD="cuda", TORCH_SPEC="torch==2.11.0",
                        TORCH_INDEX_URL="https://download.pytorch.org/whl/cu128"))
    assert out == "[install] torch: build cuda, pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128"
    assert "build cpu" in line(decision(tmp_path, smi_exit, TORCH_BUILD="cpu"))


def test_bad_build_name_is_one_clear_error(tmp_path):
    proc = decision(tmp_path, None, TORCH_BUILD="rocm")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "[install] error: TORCH_BUILD=rocm is neither cpu nor cuda: set TORCH_BUILD=cpu or TORCH_BUILD=cuda")


def fake_python(tmp_path: Path, version: str) -> Path:
    """An executable that answers every call with ``version``, as install.sh's version probe reads it."""
    fake = tmp_path / f"python-{version}"
    fake.write_text(f"#!/bin/sh\necho {version}\n")
    fake.chmod(0o755)
    return fake


def test_python_below_the_floor_is_one_line(tmp_path):
    """A Python older than 3.11 stops before anything is made, naming the fix."""
    fake = fake_python(tmp_path, "3.10")
    proc = decision(tmp_path, None, PYTHON=str(fake), INSTALL_DRY_RUN="0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"[install] error: {fake} is Python 3.10; torchscale-fairseq needs Python 3.11 or newer: "
        "set PYTHON=python3.11 (or 3.12, 3.13)")
    assert not (tmp_path / "venv").exists()


@pytest.mark.parametrize("version", ["3.11", "3.13", "3.14"])
def test_python_from_the_floor_up_is_accepted(tmp_path, version):
    """No ceiling: 3.11 and every newer Python reach the torch decision (setup.py has no upper bound)."""
    proc = decision(tmp_path, None, PYTHON=str(fake_python(tmp_path, version)))
    assert line(proc).startswith("[install] torch: build cpu, pip install torch==2.13.0")
