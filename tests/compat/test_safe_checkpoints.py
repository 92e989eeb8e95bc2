"""Checkpoints load with weights_only=True: fairseq's plain objects are allowed by the
plugin's explicit list, anything else (code execution on load) is refused."""

import argparse
import os
import subprocess
import sys

import torch

from tests.helpers import prewarmed


class RunsCodeOnLoad:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _load_in_subprocess(path, import_plugin: bool, loader: str = "torch.load") -> subprocess.CompletedProcess:
    """Load ``path`` with ``loader`` (PyTorch's default weights_only=True, or fairseq's) in a new
    process (from the prewarmed server: torch and fairseq imported, the plugin not)."""
    script = path.with_suffix(f".{'plugin' if import_plugin else 'stock'}.py")
    script.write_text(
        "import torch\nfrom fairseq import checkpoint_utils\n"
        + ("import torchscale_fairseq\n" if import_plugin else "")
        + f"state = {loader}({str(path)!r})\n"
        + "print('loaded', sorted(state))\n"
    )
    return prewarmed.run([sys.executable, script], timeout=300)


def test_namespace_checkpoint_needs_and_gets_the_allow_list(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"args": argparse.Namespace(arch="transformer", lr=[0.1]), "model": {"w": torch.ones(2)}}, path)
    stock = _load_in_subprocess(path, import_plugin=False)
    assert stock.returncode != 0 and "Namespace" in stock.stderr
    ours = _load_in_subprocess(path, import_plugin=True)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert "loaded" in ours.stdout


def test_checkpoint_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": RunsCodeOnLoad(str(marker))}, path)
    proc = _load_in_subprocess(path, import_plugin=True, loader="checkpoint_utils.load_checkpoint_to_cpu")
    assert proc.returncode != 0
    assert "refused to load" in proc.stderr and "allow-list" in proc.stderr
    assert not marker.exists()
