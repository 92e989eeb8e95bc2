"""Fixtures of the streaming-task tests: a task built from command-line style options."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import torchscale_fairseq  # noqa: F401  (registers the tasks and --bpe tiktoken_gpt2)

USER_DIR = str(Path(torchscale_fairseq.__file__).parent)


def build_task(data: Path | str, task: str = "streaming_lm", extra: tuple[str, ...] = ()):
    """A fairseq task set up from options, as ``fairseq-train`` would."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [str(data), "--task", task, "--arch", "ts_lm_tiny", "--tokens-per-sample", "16",
            "--sample-break-mode", "none", "--batch-size", "4", "--cpu", "--user-dir", USER_DIR, *extra]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    return tasks.setup_task(convert_namespace_to_omegaconf(args).task)


@pytest.fixture
def task_factory() -> Callable:
    return build_task
