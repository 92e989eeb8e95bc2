"""Perplexity of an add-one-smoothed unigram model of a binarized LM dataset's training split.

The baseline a language model must beat to show it learnt more than word frequencies:
``p(w) = (count_train(w) + 1) / (N_train + V)`` over the ``V`` entries of ``dict.txt``, and
``ppl = exp(-1/M * sum log p(w_i))`` over the ``M`` tokens of the evaluated split, every
``</s>`` included (the tokens ``fairseq-eval-lm`` scores with ``--sample-break-mode none``).

Run from the repository root: ``python -m data_prep.unigram_ppl data-bin/enwiki_gpt2 --subset valid``;
prints ``unigram_ppl P`` (and the token counts on stderr).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from fairseq.data import Dictionary, data_utils

from torchscale_fairseq.errors import TsConfigError


def split_tokens(data_dir: Path, subset: str, dictionary: Dictionary) -> np.ndarray:
    """All token ids of ``data_dir/subset.{bin,idx}``, concatenated."""
    dataset = data_utils.load_indexed_dataset(str(data_dir / subset), dictionary)
    if dataset is None or len(dataset) == 0:
        raise TsConfigError(f"{data_dir}/{subset}.bin not found or empty: prepare the data first (data_prep.prepare_lm)")
    return np.concatenate([dataset[i].numpy() for i in range(len(dataset))])


def unigram_perplexity(train: np.ndarray, evaluated: np.ndarray, vocab_size: int) -> float:
    """exp of the mean negative log-probability of ``evaluated`` under add-one-smoothed ``train`` counts."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts) - math.log(counts.sum())
    return float(math.exp(-log_p[evaluated].mean()))


def main(argv: Sequence[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help="fairseq-preprocessed LM directory (dict.txt, train.bin, ...)")
    parser.add_argument("--subset", default="valid", help="split to score (default valid)")
    args = parser.parse_args(argv)
    dictionary = Dictionary.load(str(args.data / "dict.txt"))
    train = split_tokens(args.data, "train", dictionary)
    evaluated = split_tokens(args.data, args.subset, dictionary)
    ppl = unigram_perplexity(train, evaluated, len(dictionary))
    print(f"{len(train)} train tokens, {len(evaluated)} {args.subset} tokens, vocabulary {len(dictionary)}",
          file=sys.stderr)
    print(f"unigram_ppl {ppl:.1f}")
    return ppl


if __name__ == "__main__":
    main()
