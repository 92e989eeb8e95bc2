"""``tests/`` mirrors the package: each test folder is a folder of ``torchscale_fairseq/`` or of the
repository (``data_prep``, ``scripts``, ``benchmarks``, ``experiments``), or one of the cross-cutting
folders named below; every module outside ``workers/``, ``helpers/`` and ``doubles/`` is a test
module, a ``conftest.py`` or an ``__init__.py``."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PACKAGE = REPO / "torchscale_fairseq"
SUPPORT = {"workers", "helpers", "doubles"}
CROSS_CUTTING = {"reliability", "gpu"}
REPOSITORY_FOLDERS = {"data_prep", "scripts", "benchmarks", "experiments"}


def _folders(root: Path) -> list[Path]:
    return [p.relative_to(root) for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__"]


def test_every_test_folder_mirrors_a_source_folder() -> None:
    for folder in _folders(TESTS):
        top = folder.parts[0]
        if top in SUPPORT or top in CROSS_CUTTING:
            continue
        if top in REPOSITORY_FOLDERS:
            assert len(folder.parts) == 1, f"tests/{folder}: nested under a repository folder"
            assert (REPO / top).is_dir(), f"tests/{folder}: no {top}/ in the repository"
            continue
        assert (PACKAGE / folder).is_dir(), f"tests/{folder} mirrors no torchscale_fairseq/{folder}"


def test_helpers_and_workers_live_in_their_own_folders() -> None:
    for module in TESTS.rglob("*.py"):
        relative = module.relative_to(TESTS)
        if relative.parts[0] in SUPPORT:
            continue
        assert module.name.startswith("test_") or module.name in {"conftest.py", "__init__.py"}, (
            f"tests/{relative} is neither a test module nor a conftest: move it to tests/workers/ "
            "(a process a test launches) or tests/helpers/ (code tests import)")


def test_workers_and_helpers_hold_no_tests() -> None:
    for folder in SUPPORT - {"doubles"}:
        assert not list((TESTS / folder).glob("test_*.py")), f"tests/{folder}/ holds test modules"


def test_gpu_tests_name_workers_and_paths_that_exist() -> None:
    """The GPU tests run only on a lent GPU, so a moved worker would fail there first: every path
    constant of a ``tests/gpu`` module and every ``tests.workers.*`` module it launches exists."""
    import importlib
    import re

    for module_path in sorted((TESTS / "gpu").glob("test_*.py")):
        module = importlib.import_module(f"tests.gpu.{module_path.stem}")
        for name, value in vars(module).items():
            if isinstance(value, Path) and REPO in value.parents:
                assert value.exists(), f"tests/gpu/{module_path.name}: {name} = {value} does not exist"
        for worker in re.findall(r"tests\.workers\.(\w+)", module_path.read_text()):
            assert (TESTS / "workers" / f"{worker}.py").exists(), f"tests/gpu/{module_path.name}: no tests/workers/{worker}.py"
