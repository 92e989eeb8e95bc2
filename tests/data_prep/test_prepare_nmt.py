"""NMT data preparation: SentencePiece round trip, contiguous split, default corpus, one-line input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm
from fairseq.data import Dictionary, data_utils

from data_prep import prepare_nmt

EN = [f"Sentence number {i} says: the {w} crossed the river at dawn." for i, w in
      enumerate(["fox", "king", "shepherd", "señor", "naïve café", "Zürich"] * 10)]
ES = [f"La frase número {i} dice: el {w} cruzó el río al amanecer." for i, w in
      enumerate(["zorro", "rey", "pastor", "señor", "café ingenuo", "Zúrich"] * 10)]


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nmt")
    # Blank pairs are skipped: one blank English line, one blank Spanish line.
    en, es = [*EN[:30], "", *EN[30:], "x"], [*ES[:30], "y", *ES[30:], " "]
    out = root / "bin"
    stats = prepare_nmt.main([
        "--train-src", _write(root / "all.en", en), "--train-tgt", _write(root / "all.es", es), "--out-dir", str(out),
        "--valid-size", "5", "--test-size", "4", "--vocab-size", "120", "--workers", "1",
    ])
    assert {s: stats[s]["pairs"] for s in prepare_nmt.SPLITS} == {"train": 51, "valid": 5, "test": 4}
    return out


def test_split_is_contiguous_and_held_out(prepared: Path) -> None:
    expected = {"train": (EN[:51], ES[:51]), "valid": (EN[51:56], ES[51:56]), "test": (EN[56:], ES[56:])}
    for split, (en, es) in expected.items():
        assert (prepared / "raw" / f"{split}.en").read_text(encoding="utf-8").splitlines() == en
        assert (prepared / "raw" / f"{split}.es").read_text(encoding="utf-8").splitlines() == es


def test_sentencepiece_and_binarized_data_round_trip(prepared: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(prepared / "spm.model"))
    dictionary = Dictionary.load(str(prepared / "dict.en.txt"))
    assert (prepared / "dict.en.txt").read_text() == (prepared / "dict.es.txt").read_text()  # joined
    for split in prepare_nmt.SPLITS:
        for lang, lines in (("en", EN), ("es", ES)):
            raw = (prepared / "raw" / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
            assert set(raw) <= set(lines)
            dataset = data_utils.load_indexed_dataset(str(prepared / f"{split}.en-es.{lang}"), dictionary)
            assert len(dataset) == len(raw)
            for item, line in zip(dataset, raw):
                assert sp.decode(sp.encode(line)) == line
                assert item[-1].item() == dictionary.eos()
                pieces = [dictionary[i] for i in item[:-1].tolist()]
                if split == "train":  # every train piece is in the dictionary
                    assert dictionary.unk() not in item.tolist()
                    assert sp.decode_pieces(pieces) == line


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        prepare_nmt.main(argv)
    message = str(exc.value)
    assert message.startswith("error: ") and "\n" not in message
    return message


def test_malformed_inputs_give_one_line_errors_and_write_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    en, es = _write(tmp_path / "a.en", EN), _write(tmp_path / "a.es", ES)
    short = _write(tmp_path / "short.es", ES[:-1])
    empty = _write(tmp_path / "empty.es", ["", " "] * 30)
    base = ["--out-dir", str(out), "--valid-size", "2", "--test-size", "2"]
    assert "does not exist" in _error(capsys, ["--train-src", str(tmp_path / "nope.en"), "--train-tgt", es, *base])
    msg = _error(capsys, ["--train-src", en, "--train-tgt", short, *base])
    assert "has 60 lines" in msg and "has 59" in msg
    assert "empty corpus" in _error(capsys, ["--train-src", en, "--train-tgt", empty, *base])
    assert "too few" in _error(capsys, ["--train-src", en, "--train-tgt", es, "--max-pairs", "4", *base])
    assert "go together" in _error(capsys, ["--train-src", en, "--train-tgt", es, "--valid-src", en, *base])
    (tmp_path / "bad.en").write_bytes(b"\xff\xfe broken\n")
    assert "not UTF-8" in _error(capsys, ["--train-src", str(tmp_path / "bad.en"), "--train-tgt", es, *base])
    assert not out.exists()


def test_default_corpus_is_the_aligned_bible(tmp_path: Path) -> None:
    out = tmp_path / "bible"
    prepare_nmt.main(["--out-dir", str(out), "--max-pairs", "40", "--valid-size", "3", "--test-size", "3",
                      "--vocab-size", "300", "--workers", "1"])
    refs = (out / "raw" / "train.ref").read_text().splitlines()
    assert refs[0] == "Gen.1.1" and len(refs) == 34
    # Genesis 1 has 31 verses, so pairs 38-40 are Genesis 2:7-9.
    assert (out / "raw" / "test.ref").read_text().splitlines() == ["Gen.2.7", "Gen.2.8", "Gen.2.9"]
    assert (out / "raw" / "train.en").read_text().splitlines()[0] == (
        "In the beginning God created the heaven and the earth.")
    assert (out / "raw" / "train.es").read_text().splitlines()[0] == "EN el principio crió Dios los cielos y la tierra."
