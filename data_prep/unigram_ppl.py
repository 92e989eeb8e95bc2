"""Perplexity of an add-one-smoothed unigram model of a binarized dataset's training split.

The baseline a language model must beat to show it learnt more than word frequencies:
``p(w) = (count_train(w) + 1) / (N_train + V)`` over the ``V`` entries of ``dict.txt``, and
``ppl = exp(-1/M * sum log p(w_i))`` over the ``M`` tokens of the evaluated split, every
``</s>`` included (the tokens ``fairseq-eval-lm`` scores with ``--sample-break-mode none``).

Run from the repository root: ``python -m data_prep.unigram_ppl data-bin/enwiki_gpt2 --subset valid``;
prints ``unigram_ppl P`` (and the token counts on stderr). For a translation dataset, ``--pair en-es``
scores the target side (``dict.es.txt``, ``{subset}.en-es.es``): the tokens whose perplexity
``fairseq-train --task translation`` reports.
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
    """All token ids of ``data_dir/subset.{bin,idx}``, concatenated (``subset``: e.g. ``valid`` or ``valid.en-es.es``)."""
    dataset = data_utils.load_indexed_dataset(str(data_dir / subset), dictionary)
    if dataset is None or len(dataset) == 0:
        raise TsConfigError(f"{data_dir}/{subset}.bin not found or empty: prepare the data first "
                            "(data_prep.prepare_lm or data_prep.prepare_nmt)")
    return np.concatenate([dataset[i].numpy() for i in range(len(dataset))])


def unigram_perplexity(train: np.ndarray, evaluated: np.ndarray, vocab_size: int) -> float:
    """exp of the mean negative log-probability of ``evaluated`` under add-one-smoothed ``train`` counts."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts) - math.log(counts.sum())
    return float(math.exp(-log_p[evaluated].mean()))


def main(argv: Sequence[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help="fairseq-preprocessed directory (LM: dict.txt, train.bin, ...)")
    parser.add_argument("--subset", default="valid", help="split to score (default valid)")
    parser.add_argument("--pair", metavar="SRC-TGT", help="a translation dataset: score its target side "
                        "(dict.TGT.txt, SPLIT.SRC-TGT.TGT)")
    args = parser.parse_args(argv)
    dict_name, suffix = "dict.txt", ""
    if args.pair:
        source, _, target = args.pair.partition("-")
        if not source or not target:
            parser.error(f"--pair {args.pair}: give the language pair as SRC-TGT, e.g. en-es")
        dict_name, suffix = f"dict.{target}.txt", f".{args.pair}.{target}"
    if not (args.data / dict_name).is_file():
        parser.error(f"{args.data}/{dict_name} not found: give a fairseq-preprocessed directory"
                     + ("" if args.pair else " (a translation dataset needs --pair SRC-TGT)"))
    dictionary = Dictionary.load(str(args.data / dict_name))
    try:
        train = split_tokens(args.data, "train" + suffix, dictionary)
        evaluated = split_tokens(args.data, args.subset + suffix, dictionary)
    except TsConfigError as e:
        parser.error(str(e))
    ppl = unigram_perplexity(train, evaluated, len(dictionary))
    print(f"{len(train)} train tokens, {len(evaluated)} {args.subset} tokens, vocabulary {len(dictionary)}",
          file=sys.stderr)
    print(f"unigram_ppl {ppl:.1f}")
    return ppl


if __name__ == "__main__":
    main()
