"""BLEU and chrF of copying the source sentence as the translation: the score a system gets
for names, numbers and shared words without translating anything, printed beside the model's
score (same sacrebleu settings as :mod:`data_prep.score_nmt`).

Run from the repository root::

    python -m data_prep.nmt_baseline --source data-bin/kjv_sparv_spm/raw/test.en \
        --reference data-bin/kjv_sparv_spm/raw/test.es --scores-out copy_test.txt
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as ``python data_prep/nmt_baseline.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data_prep.score_nmt import report, score


def main(argv: Sequence[str] | None = None) -> dict[str, str | float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="raw source text, one sentence per line")
    parser.add_argument("--reference", required=True, help="raw reference text, aligned with --source")
    parser.add_argument("--scores-out", help="write 'bleu B', 'chrf C' and 'bleu_signature S' lines here")
    args = parser.parse_args(argv)
    for option, value in (("--source", args.source), ("--reference", args.reference)):
        if not Path(value).is_file():
            raise SystemExit(f"error: {option} file {value} does not exist")
    source = Path(args.source).read_text(encoding="utf-8").splitlines()
    references = Path(args.reference).read_text(encoding="utf-8").splitlines()
    if len(source) != len(references):
        raise SystemExit(f"error: {len(source)} source lines but {len(references)} references; give aligned files")
    result = score(source, references)
    report({key: result[key] for key in ("bleu", "chrf", "bleu_signature")}, args.scores_out)
    return result


if __name__ == "__main__":
    main()
