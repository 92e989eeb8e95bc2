"""Prepare a GPT-2-BPE (or small SentencePiece) language-modelling dataset for fairseq (``--task language_modeling``).

Corpus: by default the English Wikipedia excerpt shipped in gensim's test data, cleaned
by :mod:`data_prep.wiki_text`; with ``--corpus web`` the World English Bible (Debian
``sword-text-web``, read by :mod:`data_prep.sword`: one document per chapter, one verse per
line, in canonical order, deuterocanon included); or your own raw text with ``--train-text``
(and optionally ``--valid-text``/``--test-text``): one paragraph per line, documents
separated by blank lines.

Split (deterministic, by document, in corpus order) when no explicit valid/test files are
given: with ``n`` documents, the last ``max(1, round(n * test_fraction))`` are the test set,
the ``max(1, round(n * valid_fraction))`` before them the valid set, the rest train.

Output directory (written only after all inputs are checked, and only if it is empty or
``--force`` is given):

* ``train|valid|test.{bin,idx}`` and ``dict.txt``: the fairseq-binarized data. ``dict.txt``
  lists the GPT-2 ids 0..50256 in order, so a fairseq id is the GPT-2 id + 4 (after
  fairseq's ``<s> <pad> </s> <unk>``); every line ends with ``</s>``, and a blank line
  (a document boundary) is a lone ``</s>``.
* ``raw/{split}.txt``: the text that was encoded, one paragraph per line.

With ``--spm-vocab N`` the tokens are pieces of a SentencePiece unigram model of ``N`` pieces
trained on the train split alone (written as ``spm.model``/``spm.vocab``), and ``dict.txt``
lists its pieces in SentencePiece id order (fairseq id = piece id + 1: SentencePiece's own
``<unk> <s> </s>`` are fairseq's). A vocabulary of a few thousand makes the embedding a small
part of a small model, as in the experiments of ``docs/results.md``.

Run from the repository root: ``python -m data_prep.prepare_lm --max-docs 50``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as ``python data_prep/prepare_lm.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tiktoken

from data_prep import sword
from data_prep.wiki_text import find_gensim_wiki_dump, wiki_documents

SPLITS = ("train", "valid", "test")
DEFAULT_OUT_DIR = "data-bin/enwiki_gpt2"
Document = list[str]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help=f"output directory (default {DEFAULT_OUT_DIR})")
    parser.add_argument("--corpus", choices=("wiki", "web"), default="wiki",
                        help="embedded corpus: gensim's Wikipedia excerpt (default) or the World English Bible")
    parser.add_argument("--sword-path", help="SWORD library root for --corpus web (default /usr/share/sword)")
    parser.add_argument("--wiki-dump", help="MediaWiki XML dump (.xml or .xml.bz2); default: gensim's excerpt")
    parser.add_argument("--train-text", help="your own training text instead of Wikipedia")
    parser.add_argument("--valid-text", help="your own validation text (needs --train-text and --test-text)")
    parser.add_argument("--test-text", help="your own test text (needs --train-text and --valid-text)")
    parser.add_argument("--max-docs", type=int, help="use only the first N documents (of each given file)")
    parser.add_argument("--valid-fraction", type=float, default=0.05, help="share of documents for valid")
    parser.add_argument("--test-fraction", type=float, default=0.05, help="share of documents for test")
    parser.add_argument("--spm-vocab", type=int,
                        help="tokenise with a SentencePiece model of this many pieces trained on train (default: GPT-2 BPE)")
    parser.add_argument("--workers", type=int, default=2, help="fairseq-preprocess workers")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out-dir")
    return parser.parse_args(argv)


def read_text_documents(path: Path, max_docs: int | None = None) -> list[Document]:
    """Documents of a raw text file: lines kept verbatim, blank lines separate documents."""
    docs: list[Document] = []
    current: Document = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.rstrip("\r\n")
            if line.strip():
                current.append(line)
                continue
            if current:
                docs.append(current)
                current = []
            if max_docs is not None and len(docs) >= max_docs:
                return docs
    if current:
        docs.append(current)
    return docs[:max_docs] if max_docs is not None else docs


def split_documents(docs: list[Document], valid_fraction: float, test_fraction: float) -> dict[str, list[Document]]:
    """Deterministic split by document: the tail is test, the part before it valid, the rest train."""
    n_valid = max(1, round(len(docs) * valid_fraction))
    n_test = max(1, round(len(docs) * test_fraction))
    n_train = len(docs) - n_valid - n_test
    if n_train < 1:
        raise SystemExit(
            f"error: {len(docs)} document(s) are too few to split into train/valid/test; "
            "use more text (or a larger --max-docs), or pass --valid-text and --test-text"
        )
    return {
        "train": docs[:n_train],
        "valid": docs[n_train : n_train + n_valid],
        "test": docs[n_train + n_valid :],
    }


def find_fairseq_preprocess() -> Path:
    """The ``fairseq-preprocess`` script installed next to the running Python."""
    path = Path(sys.executable).parent / "fairseq-preprocess"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found; fix: bash scripts/install.sh (installs fairseq into .venv)")
    return path


def _check_user_file(option: str, value: str, max_docs: int | None) -> list[Document]:
    path = Path(value)
    if not path.is_file():
        raise SystemExit(f"error: {option} file {path} does not exist")
    try:
        docs = read_text_documents(path, max_docs)
    except UnicodeDecodeError as err:
        raise SystemExit(f"error: {option} file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from err
    if not docs:
        raise SystemExit(f"error: {option} file {path} has no text (empty corpus)")
    return docs


def load_corpus(args: argparse.Namespace) -> dict[str, list[Document]]:
    """Documents per split from the options (exits with a one-line error on bad input)."""
    if args.max_docs is not None and args.max_docs < 1:
        raise SystemExit("error: --max-docs must be at least 1")
    for name in ("valid_fraction", "test_fraction"):
        if not 0 < getattr(args, name) < 0.5:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be between 0 and 0.5")
    explicit = [args.valid_text is not None, args.test_text is not None]
    if any(explicit) and not (all(explicit) and args.train_text):
        raise SystemExit("error: --valid-text and --test-text go together, and with --train-text")
    if args.train_text and args.wiki_dump:
        raise SystemExit("error: give either --train-text or --wiki-dump, not both")
    if args.corpus == "web" and (args.train_text or args.wiki_dump):
        raise SystemExit("error: --corpus web reads the World English Bible; drop --train-text/--wiki-dump")
    if all(explicit):
        return {
            split: _check_user_file(f"--{split}-text", getattr(args, f"{split}_text"), args.max_docs)
            for split in SPLITS
        }
    if args.train_text:
        docs = _check_user_file("--train-text", args.train_text, args.max_docs)
    elif args.corpus == "web":
        try:
            docs = sword.chapter_documents("web", args.sword_path)[: args.max_docs]
        except sword.SwordModuleError as err:
            raise SystemExit(f"error: {err}") from err
    else:
        try:
            dump = Path(args.wiki_dump) if args.wiki_dump else find_gensim_wiki_dump()
        except FileNotFoundError as err:
            raise SystemExit(f"error: {err}") from err
        if not dump.is_file():
            raise SystemExit(f"error: --wiki-dump file {dump} does not exist")
        try:
            docs = wiki_documents(dump, args.max_docs)
        except (ET.ParseError, OSError, EOFError) as err:
            raise SystemExit(f"error: {dump} is not a readable MediaWiki XML dump ({err})") from err
        if not docs:
            raise SystemExit(f"error: no articles with text found in {dump} (empty corpus)")
    return split_documents(docs, args.valid_fraction, args.test_fraction)


def check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse a non-directory, or a non-empty directory without ``--force``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise SystemExit(f"error: --out-dir {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise SystemExit(f"error: --out-dir {out_dir} is not empty; pass --force to overwrite it, or choose another")


def load_gpt2_encoding() -> tiktoken.Encoding:
    """The GPT-2 BPE, or a one-line exit if its asset is broken.

    Imported here, not at the top: the plugin package imports torch and fairseq, which
    input errors and ``--help`` do not need.
    """
    from torchscale_fairseq.data import gpt2_bpe

    try:
        return gpt2_bpe.get_gpt2_encoding()
    except gpt2_bpe.GPT2AssetError as err:
        raise SystemExit(f"error: {err}") from err


def write_gpt2_dict(path: Path, n_vocab: int) -> None:
    """A fairseq dictionary of the GPT-2 ids ``0..n_vocab-1`` in order (fairseq id = GPT-2 id + 4)."""
    path.write_text("".join(f"{i} 1\n" for i in range(n_vocab)), encoding="utf-8")


def write_split(
    docs: list[Document], text_path: Path, tokens_path: Path, encode: Callable[[list[str]], list[list[str]]]
) -> dict[str, int]:
    """Write the raw text and its tokens (one line each); return document/line/token counts."""
    lines: list[str] = []
    for i, doc in enumerate(docs):
        if i:
            lines.append("")
        lines.extend(doc)
    rows = encode(lines)
    text_path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tokens_path.write_text("".join(" ".join(row) + "\n" for row in rows), encoding="utf-8")
    return {"docs": len(docs), "lines": sum(len(doc) for doc in docs), "tokens": sum(len(row) for row in rows)}


def gpt2_tokenizer(dict_path: Path) -> Callable[[list[str]], list[list[str]]]:
    """GPT-2 BPE ids as strings; writes the GPT-2 dictionary to ``dict_path``."""
    encoding = load_gpt2_encoding()
    write_gpt2_dict(dict_path, encoding.n_vocab)

    def encode(lines: list[str]) -> list[list[str]]:
        return [[str(i) for i in row] for row in encoding.encode_ordinary_batch(lines, num_threads=2)]

    return encode


def sentencepiece_tokenizer(
    train_lines: list[str], vocab_size: int, prefix: Path, dict_path: Path
) -> Callable[[list[str]], list[list[str]]]:
    """Pieces of a SentencePiece unigram model trained on ``train_lines`` (``prefix.{model,vocab}``);
    writes its pieces, in id order and without SentencePiece's control pieces, to ``dict_path``."""
    from data_prep.train_spm import train_sentencepiece

    text = prefix.with_suffix(".train.txt")
    text.write_text("".join(line + "\n" for line in train_lines if line.strip()), encoding="utf-8")
    model = train_sentencepiece(text, prefix, vocab_size)
    text.unlink()
    pieces = [model.id_to_piece(i) for i in range(model.get_piece_size())]
    special = {i for i in range(len(pieces)) if model.is_control(i) or model.is_unknown(i)}
    dict_path.write_text("".join(f"{p} 1\n" for i, p in enumerate(pieces) if i not in special), encoding="utf-8")

    def encode(lines: list[str]) -> list[list[str]]:
        return model.encode(lines, out_type=str)

    return encode


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the finished files from ``tmp`` into ``out_dir``, replacing same-named ones."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in sorted(tmp.iterdir()):
        dest = out_dir / src.name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        elif dest.exists() or dest.is_symlink():
            dest.unlink()
        src.replace(dest)


def prepare(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Check inputs, then encode, binarize and install the dataset; return counts per split."""
    out_dir = Path(args.out_dir)
    check_out_dir(out_dir, args.force)
    if args.spm_vocab is not None and args.spm_vocab < 8:
        raise SystemExit(f"error: --spm-vocab {args.spm_vocab} is too small; use a few thousand, e.g. --spm-vocab 4000")
    corpus = load_corpus(args)
    preprocess = find_fairseq_preprocess()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (tmp / "raw").mkdir()
        work = Path(tempfile.mkdtemp(prefix="prepare_lm-"))
        try:
            if args.spm_vocab is None:
                encode = gpt2_tokenizer(work / "dict.txt")
            else:
                train_lines = [line for doc in corpus["train"] for line in doc]
                encode = sentencepiece_tokenizer(train_lines, args.spm_vocab, tmp / "spm", work / "dict.txt")
            stats = {
                split: write_split(corpus[split], tmp / "raw" / f"{split}.txt", work / f"{split}.tok", encode)
                for split in SPLITS
            }
            cmd = [
                str(preprocess), "--only-source", "--srcdict", str(work / "dict.txt"),
                "--trainpref", str(work / "train.tok"), "--validpref", str(work / "valid.tok"),
                "--testpref", str(work / "test.tok"), "--destdir", str(tmp), "--workers", str(args.workers),
            ]  # fmt: skip
            result = subprocess.run(cmd, check=False, capture_output=True, text=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise SystemExit(f"error: fairseq-preprocess failed (exit {result.returncode}): {tail[0]}")
        log = tmp / "preprocess.log"
        if log.is_file():
            log.write_text(log.read_text(encoding="utf-8").replace(str(tmp), str(out_dir)), encoding="utf-8")
        _install(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return stats


def format_summary(stats: dict[str, dict[str, int]], out_dir: str, spm_vocab: int | None = None) -> str:
    """A small table of documents, lines and tokens per split."""
    rows = [f"{'split':<6} {'docs':>7} {'lines':>8} {'tokens':>10}"]
    for split in SPLITS:
        s = stats[split]
        rows.append(f"{split:<6} {s['docs']:>7,} {s['lines']:>8,} {s['tokens']:>10,}")
    ids = "GPT-2 id + 4" if spm_vocab is None else f"SentencePiece id + 1, {spm_vocab} pieces"
    rows.append(f"wrote {out_dir} (fairseq id = {ids}; tokens exclude the </s> ending each line)")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, int]]:
    """Entry point: prepare the dataset and print the summary."""
    args = parse_args(argv)
    stats = prepare(args)
    print(format_summary(stats, args.out_dir, args.spm_vocab))
    return stats


if __name__ == "__main__":
    main()
