"""Shared pytest fixtures: the repository root on ``sys.path`` (for ``data_prep``) and the
tiny binarised corpora every CLI test reads; ``gpu``-marked tests are deselected, and said
to be, where CUDA is not available (never skipped silently). Each pytest process computes on
one intra-op thread, as every process the suite starts does (``tests/helpers/cli_utils.py``):
the suite runs one xdist worker per core, and a second thread per worker only waits for a core."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
NO_CUDA = "deselected: no CUDA"
_GPU_DESELECTED = pytest.StashKey[int]()


def installed_versions() -> str:
    """The versions of what the supported ranges cover (README, "Supported versions")."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    fairseq = of("fairseq-fixed") if sys.version_info >= (3, 11) else of("fairseq")
    return (f"Python {sys.version.split()[0]}, torch {torch.__version__}, numpy {of('numpy')}, "
            f"transformers {of('transformers')}, safetensors {of('safetensors')}, fairseq {fairseq}")


def pytest_report_header(config) -> list[str]:
    if CUDA:
        gpu = f"gpu tests: run on {torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    else:
        gpu = f"gpu tests: {NO_CUDA} (torch {torch.__version__})"
    return [f"versions: {installed_versions()}", gpu]


def pytest_collection_modifyitems(config, items) -> None:
    """Without CUDA, deselect the ``gpu``-marked tests (reported, not skipped)."""
    if CUDA:
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
    config.stash[_GPU_DESELECTED] = len(gpu)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    count = config.stash.get(_GPU_DESELECTED, 0)
    if count:
        terminalreporter.write_line(f"{count} gpu tests {NO_CUDA}")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (holds ``torchscale_fairseq/``, ``data_prep/`` and ``scripts/``)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory) -> Path:
    """Tiny binarised monolingual data, built once per session; tests only read it."""
    from tests.helpers.cli_utils import make_lm_data

    return make_lm_data(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="session")
def mt_data(tmp_path_factory) -> Path:
    """Tiny binarised parallel data (joined dictionary), built once per session; tests only read it."""
    from tests.helpers.cli_utils import make_mt_data

    return make_mt_data(tmp_path_factory.mktemp("mt"))


def _layers_compiled_with(monkeypatch, backend: str):
    """``--ts-compile``'s layers compiled with ``backend``; the compiled function and dynamo's caches
    are fresh before and dropped after."""
    import functools

    from torchscale_fairseq.architecture.layer import _compiled_forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    _compiled_forward.cache_clear()
    torch._dynamo.reset()
    yield
    _compiled_forward.cache_clear()
    torch._dynamo.reset()


@pytest.fixture
def aot_eager_layers(monkeypatch):
    """``--ts-compile``'s layers on the ``aot_eager`` backend: dynamo and AOTAutograd trace forward and
    backward as inductor does, without its code generation (minutes on a CPU)."""
    yield from _layers_compiled_with(monkeypatch, "aot_eager")


@pytest.fixture
def dynamo_only_layers(monkeypatch):
    """``--ts-compile``'s layers on the ``eager`` backend: dynamo's graphs, guards and cache entries as
    with any backend, run as traced (for tests of what compiles, not of compiled numerics)."""
    yield from _layers_compiled_with(monkeypatch, "eager")
