"""Prepare a SentencePiece translation dataset for fairseq (``--task translation``).

Corpus: by default English-Spanish Bible verses, the King James Version (Debian
``sword-text-kjv``) and the Reina-Valera 1909 (``sword-text-sparv``), aligned by verse
(both use the KJV versification; verses empty on either side are skipped; markup,
footnotes, headings and the KJV paragraph signs are removed, see :mod:`data_prep.sword`).
Or your own parallel text: ``--train-src``/``--train-tgt`` (one sentence per line, line i
of one file translates line i of the other), optionally with ``--valid-src/--valid-tgt``
and ``--test-src/--test-tgt``. Pairs with a blank side are skipped.

Split (contiguous, in corpus order) when no explicit valid/test files are given: the last
``--test-size`` pairs (default 1,500) are the test set, the ``--valid-size`` pairs
(default 1,500) before them the valid set, everything before that train. No valid or
test pair is ever in training.

A joint SentencePiece model (``--vocab-size``, ``--model-type``) is trained on the train
split of both languages only, then every split is encoded and binarized with
``fairseq-preprocess --joined-dictionary``. All inputs are checked before anything is
written; the output directory must be empty unless ``--force`` is given.

Output directory: ``{split}.{src}-{tgt}.{src,tgt}.{bin,idx}``, ``dict.{src,tgt}.txt``,
``spm.model``/``spm.vocab``, and ``raw/{split}.{src,tgt}`` (the plain text that was encoded;
``raw/{split}.ref`` holds the verse references of the default corpus).

Run from the repository root: ``python -m data_prep.prepare_nmt``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as ``python data_prep/prepare_nmt.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sentencepiece as spm

from data_prep import sword
from data_prep.prepare_lm import _install as install_into
from data_prep.prepare_lm import check_out_dir, find_fairseq_preprocess
from data_prep.train_spm import train_sentencepiece

SPLITS = ("train", "valid", "test")
DEFAULT_OUT_DIR = "data-bin/kjv_sparv_spm"


@dataclass
class Split:
    """Parallel sentences of one split (``refs``: verse references, when known)."""

    src: list[str]
    tgt: list[str]
    refs: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.src)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help=f"output directory (default {DEFAULT_OUT_DIR})")
    parser.add_argument("--src-lang", default="en", help="source language code (default en)")
    parser.add_argument("--tgt-lang", default="es", help="target language code (default es)")
    for split in SPLITS:
        for side in ("src", "tgt"):
            parser.add_argument(f"--{split}-{side}", help=f"your own {split} {side} text (one sentence per line)")
    parser.add_argument("--max-pairs", type=int, help="use only the first N pairs of the corpus (or of each file)")
    parser.add_argument("--valid-size", type=int, default=1500, help="pairs in valid (default 1500)")
    parser.add_argument("--test-size", type=int, default=1500, help="pairs in test (default 1500)")
    parser.add_argument("--vocab-size", type=int, default=8000, help="joint SentencePiece vocabulary (default 8000)")
    parser.add_argument("--model-type", default="unigram", choices=("unigram", "bpe"), help="SentencePiece model")
    parser.add_argument("--character-coverage", type=float, default=1.0, help="SentencePiece character coverage")
    parser.add_argument("--sword-path", help="SWORD library root (default $SWORD_PATH or /usr/share/sword)")
    parser.add_argument("--workers", type=int, default=2, help="fairseq-preprocess and SentencePiece threads")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out-dir")
    return parser.parse_args(argv)


def read_lines(option: str, value: str) -> list[str]:
    """Lines of a UTF-8 text file without line endings (one-line exit if missing or not UTF-8)."""
    path = Path(value)
    if not path.is_file():
        raise SystemExit(f"error: {option} file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise SystemExit(f"error: {option} file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from err


def read_parallel(split: str, src_path: str, tgt_path: str, max_pairs: int | None) -> Split:
    """Non-blank pairs of two line-aligned files (one-line exit on mismatched counts or an empty corpus)."""
    src = read_lines(f"--{split}-src", src_path)
    tgt = read_lines(f"--{split}-tgt", tgt_path)
    if len(src) != len(tgt):
        raise SystemExit(
            f"error: --{split}-src {src_path} has {len(src)} lines but --{split}-tgt {tgt_path} has {len(tgt)}; "
            "parallel files need one line per sentence pair"
        )
    pairs = [(s.strip(), t.strip()) for s, t in zip(src, tgt) if s.strip() and t.strip()]
    if max_pairs is not None:
        pairs = pairs[:max_pairs]
    if not pairs:
        raise SystemExit(f"error: --{split}-src/--{split}-tgt have no pair with text on both sides (empty corpus)")
    return Split([s for s, _ in pairs], [t for _, t in pairs])


def bible_pairs(sword_path: str | None, max_pairs: int | None) -> Split:
    """KJV-Reina-Valera verse pairs (one-line exit if a SWORD module is missing)."""
    try:
        pairs = sword.aligned_verses("kjv", "sparv", sword_path)
    except sword.SwordModuleError as err:
        raise SystemExit(f"error: {err}") from err
    if max_pairs is not None:
        pairs = pairs[:max_pairs]
    return Split([a.text for a, _ in pairs], [b.text for _, b in pairs], [a.ref for a, _ in pairs])


def split_contiguous(corpus: Split, valid_size: int, test_size: int) -> dict[str, Split]:
    """Train = everything before the last ``valid_size + test_size`` pairs; then valid; then test."""
    n_train = len(corpus) - valid_size - test_size
    if n_train < 1:
        raise SystemExit(
            f"error: {len(corpus)} pair(s) are too few for --valid-size {valid_size} and --test-size {test_size} "
            "plus at least one training pair"
        )
    bounds = {"train": (0, n_train), "valid": (n_train, n_train + valid_size), "test": (n_train + valid_size, None)}
    return {
        split: Split(corpus.src[a:b], corpus.tgt[a:b], corpus.refs[a:b]) for split, (a, b) in bounds.items()
    }


def load_corpus(args: argparse.Namespace) -> dict[str, Split]:
    """Pairs per split from the options (exits with a one-line error on bad input)."""
    if args.max_pairs is not None and args.max_pairs < 1:
        raise SystemExit("error: --max-pairs must be at least 1")
    if args.valid_size < 1 or args.test_size < 1:
        raise SystemExit("error: --valid-size and --test-size must be at least 1")
    if args.vocab_size < 8:
        raise SystemExit("error: --vocab-size must be at least 8")
    if args.src_lang == args.tgt_lang:
        raise SystemExit("error: --src-lang and --tgt-lang must differ")
    given = {f"{s}_{side}": getattr(args, f"{s}_{side}") for s in SPLITS for side in ("src", "tgt")}
    if any(given.values()) and not (given["train_src"] and given["train_tgt"]):
        raise SystemExit("error: your own corpus needs both --train-src and --train-tgt")
    for split in ("valid", "test"):
        if bool(given[f"{split}_src"]) != bool(given[f"{split}_tgt"]):
            raise SystemExit(f"error: --{split}-src and --{split}-tgt go together")
    if bool(given["valid_src"]) != bool(given["test_src"]):
        raise SystemExit("error: give both valid and test files, or neither (then they are split off train)")
    if given["valid_src"]:
        return {s: read_parallel(s, given[f"{s}_src"], given[f"{s}_tgt"], args.max_pairs) for s in SPLITS}
    if given["train_src"]:
        corpus = read_parallel("train", given["train_src"], given["train_tgt"], args.max_pairs)
    else:
        corpus = bible_pairs(args.sword_path, args.max_pairs)
        if not corpus.src:
            raise SystemExit("error: the SWORD modules gave no verse pairs (empty corpus)")
    return split_contiguous(corpus, args.valid_size, args.test_size)


def train_joint_sentencepiece(train: Split, prefix: Path, args: argparse.Namespace) -> spm.SentencePieceProcessor:
    """A joint SentencePiece model trained on the source and target train text."""
    text = prefix.with_suffix(".train.txt")
    text.write_text("".join(line + "\n" for line in train.src + train.tgt), encoding="utf-8")
    return train_sentencepiece(text, prefix, args.vocab_size, args.model_type, args.character_coverage, args.workers)


def encode_file(sp: spm.SentencePieceProcessor, lines: list[str], path: Path) -> int:
    """Write the space-separated pieces of ``lines``; return the number of pieces."""
    pieces = sp.encode(lines, out_type=str)
    path.write_text("".join(" ".join(row) + "\n" for row in pieces), encoding="utf-8")
    return sum(len(row) for row in pieces)


def prepare(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Check inputs, then train SentencePiece, encode, binarize and install; return counts per split."""
    out_dir = Path(args.out_dir)
    check_out_dir(out_dir, args.force)
    corpus = load_corpus(args)
    preprocess = find_fairseq_preprocess()
    src, tgt = args.src_lang, args.tgt_lang

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    work = Path(tempfile.mkdtemp(prefix="prepare_nmt-"))
    try:
        raw = tmp / "raw"
        raw.mkdir()
        sp = train_joint_sentencepiece(corpus["train"], work / "spm", args)
        for ext in ("model", "vocab"):
            shutil.copy(work / f"spm.{ext}", tmp / f"spm.{ext}")
        stats: dict[str, dict[str, int]] = {}
        for split in SPLITS:
            data = corpus[split]
            (raw / f"{split}.{src}").write_text("".join(s + "\n" for s in data.src), encoding="utf-8")
            (raw / f"{split}.{tgt}").write_text("".join(t + "\n" for t in data.tgt), encoding="utf-8")
            if data.refs:
                (raw / f"{split}.ref").write_text("".join(r + "\n" for r in data.refs), encoding="utf-8")
            stats[split] = {
                "pairs": len(data),
                f"{src}_pieces": encode_file(sp, data.src, work / f"{split}.{src}"),
                f"{tgt}_pieces": encode_file(sp, data.tgt, work / f"{split}.{tgt}"),
            }
        cmd = [
            str(preprocess), "--source-lang", src, "--target-lang", tgt, "--joined-dictionary",
            "--trainpref", str(work / "train"), "--validpref", str(work / "valid"), "--testpref", str(work / "test"),
            "--destdir", str(tmp), "--workers", str(args.workers),
        ]  # fmt: skip
        result = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise SystemExit(f"error: fairseq-preprocess failed (exit {result.returncode}): {tail[0]}")
        log = tmp / "preprocess.log"
        if log.is_file():
            text = log.read_text(encoding="utf-8").replace(str(tmp), str(out_dir)).replace(str(work), "<work>")
            log.write_text(text, encoding="utf-8")
        install_into(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    stats["vocab"] = {"spm": sp.get_piece_size()}
    return stats


def format_summary(stats: dict[str, dict[str, int]], args: argparse.Namespace) -> str:
    """A small table of pairs and SentencePiece tokens per split."""
    src, tgt = args.src_lang, args.tgt_lang
    rows = [f"{'split':<6} {'pairs':>8} {src + ' pieces':>12} {tgt + ' pieces':>12}"]
    for split in SPLITS:
        s = stats[split]
        rows.append(f"{split:<6} {s['pairs']:>8,} {s[f'{src}_pieces']:>12,} {s[f'{tgt}_pieces']:>12,}")
    rows.append(f"wrote {args.out_dir} (joint SentencePiece {args.model_type}, {stats['vocab']['spm']:,} pieces)")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, int]]:
    """Entry point: prepare the dataset and print the summary."""
    args = parse_args(argv)
    stats = prepare(args)
    print(format_summary(stats, args))
    return stats


if __name__ == "__main__":
    main()
