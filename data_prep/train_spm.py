"""Train the SentencePiece model of a ``--task streaming_mlm`` dataset (offline).

Reads the train shards listed in ``DATA/json/train.json`` (the streaming index; see
``torchscale_fairseq.data.stream_index``), takes up to ``--max-lines`` non-blank lines
in index order, and writes ``DATA/spm.model`` and ``DATA/spm.vocab`` (``--output`` sets
another prefix). An existing model is never overwritten unless ``--force`` is given.

Run from the repository root: ``python -m data_prep.train_spm DATA --vocab-size 8000``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as ``python data_prep/train_spm.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sentencepiece as spm

from torchscale_fairseq.data.stream_index import load_index
from torchscale_fairseq.data.text_shards import ShardReader
from torchscale_fairseq.errors import TsConfigError


def train_sentencepiece(text: Path, prefix: Path, vocab_size: int, model_type: str = "unigram",
                        character_coverage: float = 1.0, threads: int = 2) -> spm.SentencePieceProcessor:
    """A SentencePiece model trained on ``text`` (one sentence per line), written to ``prefix.{model,vocab}``."""
    try:
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(prefix), vocab_size=vocab_size, model_type=model_type,
            character_coverage=character_coverage, hard_vocab_limit=False, num_threads=threads,
            input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2,
        )  # fmt: skip
    except (RuntimeError, OSError) as err:
        raise SystemExit(f"error: SentencePiece training failed: {str(err).strip().splitlines()[-1]}") from err
    return spm.SentencePieceProcessor(model_file=str(prefix.with_suffix(".model")))


def index_lines(data: str, max_lines: int) -> list[str]:
    """Up to ``max_lines`` non-blank lines of the train shards, in index order."""
    lines: list[str] = []
    for corpus in load_index(data, "train"):
        for shard in corpus.shards:
            for doc in ShardReader(shard):
                lines.extend(doc.lines[: max_lines - len(lines)])
                if len(lines) >= max_lines:
                    return lines
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="directory holding json/train.json and its shards")
    parser.add_argument("--vocab-size", type=int, default=8000, help="SentencePiece vocabulary (default 8000)")
    parser.add_argument("--model-type", default="unigram", choices=("unigram", "bpe"), help="SentencePiece model")
    parser.add_argument("--max-lines", type=int, default=1_000_000, help="training lines read from the shards")
    parser.add_argument("--output", help="model prefix (default DATA/spm)")
    parser.add_argument("--force", action="store_true", help="replace an existing model")
    args = parser.parse_args(argv)
    prefix = Path(args.output) if args.output else Path(args.data) / "spm"
    model = prefix.with_suffix(".model")
    if model.exists() and not args.force:
        raise SystemExit(f"error: {model} exists; pass --force to replace it")
    if args.vocab_size < 8 or args.max_lines < 1:
        raise SystemExit("error: --vocab-size must be at least 8 and --max-lines positive")
    try:
        lines = index_lines(args.data, args.max_lines)
    except TsConfigError as err:
        raise SystemExit(f"error: {err}") from err
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "train.txt"
        text.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        sp = train_sentencepiece(text, Path(tmp) / "spm", args.vocab_size, args.model_type)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        for ext in ("model", "vocab"):
            (Path(tmp) / f"spm.{ext}").replace(prefix.with_suffix(f".{ext}"))
    print(f"wrote {model} ({sp.get_piece_size():,} pieces from {len(lines):,} lines)")


if __name__ == "__main__":
    main()
