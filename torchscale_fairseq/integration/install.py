"""The one place where the plugin changes fairseq (importing the package calls
:func:`install` once). :data:`REPLACED` lists every fairseq attribute the plugin
replaces and why; the README's table is this list, and
``tests/integration/test_fairseq_seam.py`` checks it against what importing the plugin
actually changes.
"""

from __future__ import annotations

import sys
from enum import Enum
from types import ModuleType

from fairseq import checkpoint_utils
from fairseq.dataclass.constants import ZERO_SHARDING_CHOICES
from fairseq.distributed import utils as distributed_utils

from torchscale_fairseq.compat import apply_fairseq_fixes
from torchscale_fairseq.criterions import vocab_parallel
from torchscale_fairseq.errors import install_excepthook
from torchscale_fairseq.integration import (
    checkpoint_loading,
    eval_tools,
    tensor_parallel_init,
)
from torchscale_fairseq.integration.trainer import TsTrainer

# (module, attribute, why); "compat" rows fix upstream bugs, the others are the plugin's features
REPLACED: list[tuple[str, str, str]] = [
    ("fairseq.data.data_utils", "batch_by_size",
     "compat: fairseq-fixed 0.12.3.1 drops the last batch unless it fills --required-batch-size-multiple (fairseq #5036)"),
    ("fairseq.ngram_repeat_block", "NGramRepeatBlock.forward",
     "compat: --no-repeat-ngram-size blocks nothing without the CUDA extension (fairseq #5206)"),
    ("fairseq.file_io", "PathManager.copy",
     "compat: copies onto checkpoint_last/best are not atomic (a kill corrupts them)"),
    ("fairseq.distributed.utils", "infer_init_method",
     "compat: torchrun's world size and rank are ignored on CPU (or divided by zero GPUs)"),
    ("fairseq.models.distributed_fairseq_model", "DistributedDataParallel",
     "compat: c10d DDP rejects the device_ids fairseq passes for CPU modules"),
    ("fairseq.optim.fp16_optimizer", "_FP16OptimizerMixin.build_fp32_params",
     "compat: --fp16's flat fp32 master calls torch.cuda.current_device() (fails on CPU)"),
    ("fairseq.data.iterators", "BackgroundConsumer",
     "compat: the batch prefetch thread, still collating at exit, aborts the process (bpo-42969)"),
    ("fairseq.checkpoint_utils", "verify_checkpoint_directory",
     "compat: the save-dir check creates and removes a file named dummy there (runs starting in one dir remove "
     "each other's; a user's dummy is deleted)"),
    ("fairseq.distributed.utils", "distributed_init",
     "tensor parallelism: our groups and RNG streams instead of the Megatron submodule"),
    ("fairseq.checkpoint_utils", "load_checkpoint_to_cpu",
     "one-line refusal of unreadable checkpoints and of parts saved at another tensor-parallel size"),
    ("fairseq.checkpoint_utils", "get_maybe_sharded_checkpoint_filename",
     "one-line refusal of checkpoint part names that do not match --model-parallel-size"),
    ("fairseq_cli.train", "Trainer",
     "the plugin's trainer (torchscale_fairseq.integration.trainer.TsTrainer)"),
    ("fairseq_cli.train", "MegatronTrainer",
     "the same trainer at --model-parallel-size > 1 (stock needs the Megatron submodule)"),
    ("fairseq_cli.generate", "main",
     "fairseq-generate at --model-parallel-size > 1 (only while that tool runs)"),
    ("fairseq_cli.eval_lm", "main",
     "fairseq-eval-lm at --model-parallel-size > 1 (only while that tool runs)"),
]

# choices the plugin adds to fairseq's options (members added to fairseq's own enum, which the
# argument parser and the config both read): (option, choice, why)
ADDED_CHOICES: list[tuple[str, str, str]] = [
    ("--zero-sharding", "full",
     "parameters, gradients and optimizer state sharded by FSDP2 (torchscale_fairseq.optim.fully_sharded)"),
]

_EVAL_TOOLS = ("fairseq_cli.generate", "fairseq_cli.eval_lm")
_CONSOLE_TOOLS = ("fairseq_cli.train", "fairseq_cli.generate", "fairseq_cli.eval_lm",
                  "fairseq_cli.interactive", "fairseq_cli.validate", "fairseq_cli.preprocess",
                  "fairseq_cli.hydra_train", "fairseq_cli.score")


def _running_tool() -> str | None:
    """The fairseq console tool this process runs (``fairseq-train`` or
    ``python -m fairseq_cli.train``), ``None`` for a library import."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name in _CONSOLE_TOOLS:
        return spec_name
    program = sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else ""
    if program.startswith("fairseq-"):
        return "fairseq_cli." + program[len("fairseq-"):].replace("-", "_")
    return None


def _tool_modules(name: str) -> list[ModuleType]:
    """``fairseq_cli.<name>`` as imported, and ``__main__`` when it runs as that module."""
    found = [sys.modules[name]] if name in sys.modules else []
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == name:
        found.append(main)
    return found


def _add_choice(choices: type[Enum], value: str) -> None:
    """Add ``value`` to a fairseq ``ChoiceEnum`` (a ``StrEnum``) in place."""
    if value in choices._value2member_map_:
        return
    member = str.__new__(choices, value) if issubclass(choices, str) else object.__new__(choices)
    member._name_, member._value_, member.__objclass__ = value, value, choices
    choices._member_map_[value] = member
    choices._value2member_map_[value] = member
    choices._member_names_.append(value)


def install() -> None:
    """Apply the upstream fixes and install the plugin's features into fairseq."""
    import fairseq_cli.train

    apply_fairseq_fixes()
    distributed_utils.distributed_init = tensor_parallel_init.distributed_init
    checkpoint_utils.load_checkpoint_to_cpu = checkpoint_loading.load_checkpoint_to_cpu
    checkpoint_utils.get_maybe_sharded_checkpoint_filename = checkpoint_loading.get_maybe_sharded_checkpoint_filename
    for module in _tool_modules(fairseq_cli.train.__name__):
        module.Trainer = TsTrainer
        module.MegatronTrainer = TsTrainer
    for name in _EVAL_TOOLS:  # eval_lm configures logging on import: only wrap a tool that runs
        for module in _tool_modules(name):
            module.main = eval_tools.wrap_main(module.main)
    vocab_parallel.install()
    _add_choice(ZERO_SHARDING_CHOICES, "full")  # ADDED_CHOICES
    if _running_tool() is not None:
        install_excepthook()
