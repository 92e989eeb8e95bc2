"""The plugin's seam with fairseq: importing it replaces exactly the fairseq attributes
listed in ``integration.install.REPLACED`` (derived here from fairseq itself, by
snapshotting its modules before and after the import, in a fresh process), at most 15 of
them, and the README's table is that list."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO_ROOT
from tests.helpers.cli_utils import cli_env

SNAPSHOT = r"""
import importlib, inspect, json, sys
MODULES = ["fairseq.checkpoint_utils", "fairseq.data.data_utils", "fairseq.data.iterators", "fairseq.distributed.utils",
           "fairseq.file_io",
           "fairseq.models", "fairseq.models.distributed_fairseq_model", "fairseq.ngram_repeat_block",
           "fairseq.optim.fp16_optimizer", "fairseq.sequence_generator", "fairseq.tasks.fairseq_task",
           "fairseq.trainer", "fairseq.utils", "fairseq.options", "fairseq.criterions",
           "fairseq_cli.train", "fairseq_cli.generate", "fairseq_cli.eval_lm"]
for name in MODULES:
    importlib.import_module(name)
sys.argv[0] = "fairseq-generate"  # a tool runs: its main is wrapped too

def snapshot():
    seen, out = set(), {}
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("fairseq") or module is None or id(module) in seen:
            continue
        seen.add(id(module))
        for attr, value in list(vars(module).items()):
            out[(module.__name__, attr)] = value
            if inspect.isclass(value) and value.__module__ == name:
                for inner, inner_value in list(vars(value).items()):
                    out[(module.__name__, f"{attr}.{inner}")] = inner_value
    return out

before = snapshot()
import torchscale_fairseq
from torchscale_fairseq.integration.install import REPLACED
after = snapshot()
changed = sorted(k for k in before if k in after and before[k] is not after[k])
print(json.dumps({"changed": changed, "listed": [[m, a] for m, a, _ in REPLACED],
                  "excepthook": sys.excepthook is not sys.__excepthook__}))
"""


def _snapshot(*pre: str) -> dict:
    code = "\n".join(pre) + SNAPSHOT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_replaces_exactly_the_listed_attributes():
    seen = _snapshot("import fairseq_cli.generate")
    assert sorted(map(tuple, seen["changed"])) == sorted(map(tuple, seen["listed"]))
    assert len(seen["changed"]) <= 15
    assert seen["excepthook"]  # a fairseq console tool prints one-line errors


def test_readme_lists_every_replaced_attribute():
    from torchscale_fairseq.integration.install import REPLACED

    readme = (REPO_ROOT / "README.md").read_text()
    for module, attribute, why in REPLACED:
        assert f"| `{module}` | `{attribute}` | {why} |" in readme, (module, attribute)


def test_library_import_installs_no_excepthook():
    code = "import sys, torchscale_fairseq; print(sys.excepthook is sys.__excepthook__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True)
    assert proc.stdout.strip().splitlines()[-1] == "True"


def _package_sources(*folders: str):
    package = REPO_ROOT / "torchscale_fairseq"
    for folder in folders or ("",):
        yield from sorted((package / folder).rglob("*.py"))


def test_no_library_source_is_executed_and_no_frame_is_inspected():
    banned = ("exec(", "inspect.getsource", "_getframe", "f_locals", "currentframe(")
    for path in _package_sources():
        text = path.read_text()
        assert not [b for b in banned if b in text], path


def test_lower_layers_do_not_import_fairseq_registrations():
    """``model_parallel/``, ``modules/`` and ``checkpoints/`` are plain PyTorch: no fairseq, no plugin glue."""
    upper = ("fairseq", "torchscale_fairseq.models", "torchscale_fairseq.criterions", "torchscale_fairseq.tasks",
             "torchscale_fairseq.integration", "torchscale_fairseq.compat", "torchscale_fairseq.optim",
             "torchscale_fairseq.cli", "torchscale_fairseq.architecture")
    for path in _package_sources("model_parallel", "modules", "checkpoints"):
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) > 1 and words[0] in ("import", "from"):
                assert not any(words[1] == u or words[1].startswith(u + ".") for u in upper), (path, line)
