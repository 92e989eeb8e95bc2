"""SWORD zText reading and KJV / Reina-Valera verse alignment, checked against known verse texts."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from data_prep import sword

# Known texts (King James Version 1769 and Reina-Valera 1909, public domain).
KJV = {
    "Gen.1.1": "In the beginning God created the heaven and the earth.",
    "Gen.1.6": "And God said, Let there be a firmament in the midst of the waters, "
    "and let it divide the waters from the waters.",
    "John.3.16": "For God so loved the world, that he gave his only begotten Son, that whosoever "
    "believeth in him should not perish, but have everlasting life.",
    "Rev.22.21": "The grace of our Lord Jesus Christ be with you all. Amen.",
}
RV1909 = {
    "Gen.1.1": "EN el principio crió Dios los cielos y la tierra.",
    "John.3.16": "Porque de tal manera amó Dios al mundo, que ha dado á su Hijo unigénito, para que todo "
    "aquel que en él cree, no se pierda, mas tenga vida eterna.",
}


@pytest.fixture(scope="module")
def pairs() -> tuple[tuple[sword.Verse, sword.Verse], ...]:
    return sword.aligned_verses("kjv", "sparv")


def test_known_verses_align(pairs: tuple[tuple[sword.Verse, sword.Verse], ...]) -> None:
    by_ref = {en.ref: (en.text, es.text) for en, es in pairs}
    for ref, text in KJV.items():
        assert by_ref[ref][0] == text, ref
    for ref, text in RV1909.items():
        assert by_ref[ref][1] == text, ref
    assert pairs[0][0].ref == "Gen.1.1" and pairs[-1][0].ref == "Rev.22.21"


def test_pairs_cover_the_versification_once_and_have_no_markup(pairs) -> None:
    # 23,145 OT + 7,957 NT verses in the KJV versification; the Reina-Valera leaves 18 empty.
    assert len(pairs) == 31102 - 18
    assert len({en.ref for en, _ in pairs}) == len(pairs)
    for en, es in pairs:
        for text in (en.text, es.text):
            assert "<" not in text and ">" not in text and "\u00b6" not in text and "&" not in text, en.ref
            assert text == text.strip() and "  " not in text, en.ref


def test_kjv_paragraph_sign_is_stripped() -> None:
    raw = next(v.text for v in sword.iter_verses("kjv", keep_markup=True) if v.ref == "Gen.1.6")
    assert "\u00b6" in raw


def test_strip_markup_on_osis_snippets() -> None:
    osis = (
        '<div sID="a" type="x-p"/>\u00b6 <w lemma="strong:H1">And</w> <divineName>the LORD</divineName>'
        '<note placement="foot"><reference type="annotateRef">1:1 </reference>a note</note> '
        '<title type="psalm" canonical="true">A Psalm</title><transChange type="added">so</transChange>'
        '<w lemma="x">went</w> &amp; came <q who="Jesus">\u201cyes\u201d</q> .'
    )
    assert sword.strip_markup(osis) == "And the LORD so went & came \u201cyes\u201d."
    assert sword.strip_markup('x<div type="glossary">Glossary text</div>') == "x"


def _write_testament(directory: Path, name: str, entries: list[bytes], per_block: int = 3) -> None:
    bzs, bzv, bzz = b"", b"", b""
    for b, start in enumerate(range(0, len(entries), per_block)):
        chunk = entries[start : start + per_block]
        block = b"".join(chunk)
        offset = 0
        for e in chunk:
            bzv += struct.pack("<IIH", b, offset, len(e))
            offset += len(e)
        data = zlib.compress(block)
        bzs += struct.pack("<III", len(bzz), len(data), len(block))
        bzz += data
    for ext, data in (("bzs", bzs), ("bzv", bzv), ("bzz", bzz)):
        (directory / f"{name}.{ext}").write_bytes(data)


def test_read_testament_of_a_handmade_module(tmp_path: Path) -> None:
    entries = [b"", b"<milestone/>", b"head", "caf\u00e9".encode(), b"", b"<w>x</w> y", b"z"]
    _write_testament(tmp_path, "ot", entries)
    assert sword.read_testament(tmp_path, "ot") == entries


def test_module_with_wrong_entry_count_is_an_error(tmp_path: Path) -> None:
    module = tmp_path / "modules" / "texts" / "ztext" / "engKJV2006eb"
    module.mkdir(parents=True)
    for testament in sword.TESTAMENTS:
        _write_testament(module, testament, [b"", b"", b"x"])
    with pytest.raises(sword.SwordModuleError, match="versification needs"):
        list(sword.iter_verses("kjv", str(tmp_path)))
    with pytest.raises(sword.SwordModuleError, match="apt-get install -y sword-text-web"):
        sword.module_dir("web", str(tmp_path))
