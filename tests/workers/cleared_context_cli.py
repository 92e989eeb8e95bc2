"""``python cleared_context_cli.py fairseq-train ARGS...``: :mod:`unrounded_cli`'s tool with the
parallel context's module global cleared as soon as the plugin's trainer is built, after fairseq's
factories (task, model, criterion, trainer) read it: any later read is an error
(:func:`~torchscale_fairseq.model_parallel.parallel_context.current_parallel_context` raises in a
run of several ranks). Prints ``parallel context cleared`` once it is."""

from __future__ import annotations

from tests.workers import unrounded_cli
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.trainer import TsTrainer
from torchscale_fairseq.model_parallel.parallel_context import current_parallel_context, destroy_parallel_context

CLEARED = "parallel context cleared"


def main() -> None:
    build = TsTrainer.__init__

    def build_then_clear(trainer: TsTrainer, *args, **kwargs) -> None:
        build(trainer, *args, **kwargs)
        destroy_parallel_context()
        try:
            current_parallel_context()
        except TsConfigError:
            print(CLEARED, flush=True)

    TsTrainer.__init__ = build_then_clear
    unrounded_cli.main()


if __name__ == "__main__":
    main()
