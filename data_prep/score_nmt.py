"""Score ``fairseq-generate`` output: SentencePiece-decode the hypotheses, then BLEU and chrF with sacrebleu.

The hypotheses (``H-<id>`` lines, SentencePiece pieces) are put back in corpus order, decoded
with the data's ``spm.model``, and compared with the raw (untokenised) reference text, so the
scores are sacrebleu's standard detokenised BLEU (13a tokeniser) and chrF.

Run from the repository root::

    python -m data_prep.score_nmt --generate-output generate_test.txt \
        --spm-model data-bin/kjv_sparv_spm/spm.model --reference data-bin/kjv_sparv_spm/raw/test.es
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as ``python data_prep/score_nmt.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sacrebleu
import sentencepiece as spm


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generate-output", required=True, help="stdout of fairseq-generate")
    parser.add_argument("--spm-model", required=True, help="SentencePiece model of the data (spm.model)")
    parser.add_argument("--reference", required=True, help="raw reference text, one sentence per line")
    parser.add_argument("--hypothesis-out", help="write the decoded hypotheses here (corpus order)")
    parser.add_argument("--scores-out", help="write the scores here")
    return parser.parse_args(argv)


def read_hypotheses(path: Path) -> dict[int, list[str]]:
    """Sentence id -> hypothesis pieces of the ``H-`` lines of fairseq-generate output (first best)."""
    hyps: dict[int, list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("H-"):
                continue
            fields = line.rstrip("\n").split("\t")
            sent_id = int(fields[0][2:])
            if sent_id not in hyps:
                hyps[sent_id] = fields[2].split() if len(fields) > 2 else []
    return hyps


def decode_hypotheses(hyps: dict[int, list[str]], n_refs: int, model: Path) -> list[str]:
    """Detokenised hypotheses in corpus order (exits if ids do not cover the references)."""
    if sorted(hyps) != list(range(n_refs)):
        missing = sorted(set(range(n_refs)) - set(hyps))[:5]
        raise SystemExit(
            f"error: the generate output has {len(hyps)} hypotheses for {n_refs} references "
            f"(missing ids {missing}...); generate the whole split"
        )
    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [sp.decode_pieces(hyps[i]) for i in range(n_refs)]


def score(hypotheses: list[str], references: list[str]) -> dict[str, str | float]:
    """Corpus BLEU and chrF (sacrebleu defaults) with their signatures."""
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": round(b.score, 2),
        "chrf": round(c.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bleu_detail": str(b),
    }


def report(result: dict[str, str | float], scores_out: str | None) -> None:
    """Print ``key value`` lines of ``result`` (and write them to ``scores_out`` when given)."""
    text = "".join(f"{key} {value}\n" for key, value in result.items())
    if scores_out:
        Path(scores_out).write_text(text, encoding="utf-8")
    print(text, end="")


def main(argv: Sequence[str] | None = None) -> dict[str, str | float]:
    """Entry point: decode, score, print and optionally write the results."""
    args = parse_args(argv)
    for option, value in (("--generate-output", args.generate_output), ("--spm-model", args.spm_model),
                          ("--reference", args.reference)):
        if not Path(value).is_file():
            raise SystemExit(f"error: {option} file {value} does not exist")
    references = Path(args.reference).read_text(encoding="utf-8").splitlines()
    hypotheses = decode_hypotheses(read_hypotheses(Path(args.generate_output)), len(references), Path(args.spm_model))
    result = score(hypotheses, references)
    if args.hypothesis_out:
        Path(args.hypothesis_out).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    report(result, args.scores_out)
    return result


if __name__ == "__main__":
    main()
