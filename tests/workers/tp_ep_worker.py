"""One rank of a real ``fairseq-train`` run (the console tool's own ``cli_main``), then
the trained model's log-probabilities on a fixed batch, computed by all ranks together
(forward only, eval mode) and saved by global rank 0: the reference a converted
checkpoint must reproduce on one process.

Usage: ``python -m tests.workers.tp_ep_worker OUT fairseq-train ARGS...``.
"""

from __future__ import annotations

import sys

import torch

BATCH, LENGTH = 4, 16


def fixed_batch(vocab: int, first_word: int) -> torch.Tensor:
    """``BATCH x (LENGTH + 1)`` word ids (inputs and next-word targets)."""
    g = torch.Generator().manual_seed(2024)
    return torch.randint(first_word, vocab, (BATCH, LENGTH + 1), generator=g)


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    import fairseq_cli.train

    import torchscale_fairseq  # noqa: F401  (installs the plugin's trainer before cli_main parses --user-dir)

    trainers = []

    class RecordingTrainer(fairseq_cli.train.Trainer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            trainers.append(self)

    fairseq_cli.train.Trainer = fairseq_cli.train.MegatronTrainer = RecordingTrainer
    sys.argv = argv
    fairseq_cli.train.cli_main()
    trainer = trainers[0]
    model, dictionary = trainer.get_model(), trainer.task.target_dictionary
    tokens = fixed_batch(len(dictionary), dictionary.nspecial)
    model.eval()
    with torch.no_grad():
        lprobs = model.get_normalized_probs(model(tokens[:, :-1]), log_probs=True)
    if torch.distributed.get_rank() == 0:
        torch.save({"tokens": tokens, "lprobs": lprobs}, out)


if __name__ == "__main__":
    main()
