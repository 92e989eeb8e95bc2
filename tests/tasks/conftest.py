"""Fixtures of the streaming-task tests: a task built from command-line style options."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

import torchscale_fairseq  # noqa: F401  (registers the tasks and --bpe tiktoken_gpt2)

USER_DIR = str(Path(torchscale_fairseq.__file__).parent)


def build_task(data: Path | str, task: str = "streaming_lm", extra: tuple[str, ...] = ()):
    """A fairseq task set up from options, as ``fairseq-train`` would."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    if task == "streaming_mlm":
        argv = [str(data), "--task", task, "--arch", "ts_mlm_tiny", "--tokens-per-sample", "16"]
    else:
        argv = [str(data), "--task", task, "--arch", "ts_lm_tiny", "--tokens-per-sample", "16",
                "--sample-break-mode", "none"]
    argv += ["--batch-size", "4", "--cpu", "--user-dir", USER_DIR, *extra]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    return tasks.setup_task(convert_namespace_to_omegaconf(args).task)


@pytest.fixture
def task_factory() -> Callable:
    return build_task


def batches(task, n: int, num_workers: int = 0, state: dict | None = None, epoch_len: int = 3) -> tuple[list, dict]:
    """``n`` training batches (continuing from ``state``) and the iterator state after them."""
    task.options.batches_per_epoch = epoch_len
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_sentences=4, num_workers=num_workers)
    if state is not None:
        itr.load_state_dict(state)
    out = []
    while len(out) < n:
        epoch = itr.next_epoch_itr()
        for sample in itertools.islice(epoch, n - len(out)):
            out.append(sample)
    result = itr.state_dict()
    itr.close()
    return out, result
