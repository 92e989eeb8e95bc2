"""Read SWORD zText Bible modules (the Debian ``sword-text-*`` packages) with ``struct`` and ``zlib``.

A zText module holds three files per testament (``ot``/``nt``):

* ``.bzv``: one 10-byte record per index entry, ``<uint32 block, uint32 offset, uint16 size>``;
* ``.bzs``: one 12-byte record per block, ``<uint32 offset, uint32 compressed size, uint32 size>``;
* ``.bzz``: the zlib-compressed blocks.

Index entries follow the module's versification: entry 0 is the module heading, entry 1 the
testament heading, then per book one book-heading entry and per chapter one chapter-heading
entry followed by the chapter's verses. The verse text is OSIS markup; :func:`strip_markup`
turns it into plain text (footnotes, headings and the KJV paragraph signs removed).
"""

from __future__ import annotations

import functools
import html
import os
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from data_prep.versification import VERSIFICATIONS

DEFAULT_SWORD_PATH = "/usr/share/sword"
TESTAMENTS = ("ot", "nt")


@dataclass(frozen=True)
class ModuleInfo:
    """An installed SWORD module known to the data preparation."""

    name: str  # module id = directory name under modules/texts/ztext
    package: str  # Debian package that installs it
    versification: str  # key of VERSIFICATIONS


MODULES = {
    "kjv": ModuleInfo("engKJV2006eb", "sword-text-kjv", "kjv"),
    "sparv": ModuleInfo("spaRV1909eb", "sword-text-sparv", "kjv"),
    "web": ModuleInfo("engWEB2015eb", "sword-text-web", "nrsva"),
}


class SwordModuleError(FileNotFoundError):
    """A SWORD module is missing or its files do not match its versification."""


@dataclass(frozen=True)
class Verse:
    """One verse: OSIS book id, chapter and verse number (1-based) and its plain text."""

    book: str
    chapter: int
    verse: int
    text: str

    @property
    def ref(self) -> str:
        """The OSIS reference, e.g. ``Gen.1.1``."""
        return f"{self.book}.{self.chapter}.{self.verse}"


def module_dir(key: str, sword_path: str | None = None) -> Path:
    """Directory of module ``key`` (``kjv``, ``sparv``, ``web``); ``$SWORD_PATH`` overrides the root."""
    info = MODULES[key]
    root = Path(sword_path or os.environ.get("SWORD_PATH") or DEFAULT_SWORD_PATH)
    path = root / "modules" / "texts" / "ztext" / info.name.lower()
    for candidate in (path, path.with_name(info.name)):
        if (candidate / "ot.bzv").is_file():
            return candidate
    raise SwordModuleError(
        f"SWORD module {info.name} not found under {root}; fix: apt-get install -y {info.package} "
        "(or bash scripts/install.sh)"
    )


def read_testament(directory: Path, testament: str) -> list[bytes]:
    """The raw (UTF-8 OSIS) bytes of every index entry of one testament, in index order."""
    try:
        bzv = (directory / f"{testament}.bzv").read_bytes()
        bzs = (directory / f"{testament}.bzs").read_bytes()
        bzz = (directory / f"{testament}.bzz").read_bytes()
    except FileNotFoundError as err:
        raise SwordModuleError(f"SWORD module file {err.filename} is missing") from err
    blocks = [struct.unpack_from("<III", bzs, i) for i in range(0, len(bzs) - 11, 12)]
    cache: dict[int, bytes] = {}
    entries: list[bytes] = []
    for i in range(0, len(bzv) - 9, 10):
        block, offset, size = struct.unpack_from("<IIH", bzv, i)
        if size == 0:
            entries.append(b"")
            continue
        if block not in cache:
            start, compressed, _ = blocks[block]
            cache[block] = zlib.decompress(bzz[start : start + compressed])
        entries.append(cache[block][offset : offset + size])
    return entries


def iter_verses(key: str, sword_path: str | None = None, keep_markup: bool = False) -> Iterator[Verse]:
    """All verses of module ``key`` in canonical order (empty ones too), as plain text by default."""
    directory = module_dir(key, sword_path)
    canon = VERSIFICATIONS[MODULES[key].versification]
    for testament in TESTAMENTS:
        entries = read_testament(directory, testament)
        books = canon[testament]
        expected = 2 + sum(1 + len(chapters) + sum(chapters) for _, chapters in books)
        if len(entries) != expected:
            raise SwordModuleError(
                f"{directory}/{testament}.bzv has {len(entries)} entries, the {MODULES[key].versification} "
                f"versification needs {expected}"
            )
        index = 2
        for book, chapters in books:
            index += 1
            for chapter, n_verses in enumerate(chapters, start=1):
                index += 1
                for verse in range(1, n_verses + 1):
                    raw = entries[index].decode("utf-8", errors="replace")
                    yield Verse(book, chapter, verse, raw if keep_markup else strip_markup(raw))
                    index += 1


# Non-scripture matter (a glossary, back matter) stored in the entry of the last verse before it.
_NON_SCRIPTURE_DIV = re.compile(r"<div\b[^>]*\btype=\"(?:glossary|back|front|introduction|colophon)\"")
_NOTE = re.compile(r"<note\b[^>]*?(?<!/)>.*?</note>", re.DOTALL)
_DROPPED = re.compile(r"<(title|rdg|speaker|catchWord)\b[^>]*?(?<!/)>.*?</\1>", re.DOTALL)
# Added words (``transChange``) written flush against the next or previous word (Reina-Valera).
_FLUSH_ADDED = re.compile(r"(?<=\w)(</transChange>(?=<w\b)|</w>(?=<transChange\b))")
_EMPTY_TAG = re.compile(r"<[^>]*/>")
_TAG = re.compile(r"<[^>]*>")
_SPACES = re.compile(r"\s+")
_SPACE_BEFORE_PUNCT = re.compile(r" +([,;:.!?)\]»”’])")
_SPACE_AFTER_OPEN = re.compile(r"([(\[«“]) +")


def strip_markup(osis: str) -> str:
    """Plain text of one verse's OSIS markup.

    Footnotes, headings (including psalm titles), alternative readings, KJV paragraph signs and
    trailing non-scripture matter (a glossary) are removed; milestone (self-closing) elements
    become spaces, other tags disappear.
    """
    text = _NON_SCRIPTURE_DIV.split(osis, maxsplit=1)[0]
    text = _NOTE.sub(" ", text)
    text = _DROPPED.sub(" ", text)
    text = _FLUSH_ADDED.sub(r"\1 ", text)
    text = _EMPTY_TAG.sub(" ", text)
    text = _TAG.sub("", text)
    text = html.unescape(text).replace("\u00b6", " ")
    text = _SPACES.sub(" ", text).strip()
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    return _SPACE_AFTER_OPEN.sub(r"\1", text)


@functools.lru_cache(maxsize=4)
def aligned_verses(src: str, tgt: str, sword_path: str | None = None) -> tuple[tuple[Verse, Verse], ...]:
    """Verse pairs of two modules with the same versification, skipping verses empty on either side.

    Cached per process (reading and cleaning two whole Bibles takes seconds).
    """
    if MODULES[src].versification != MODULES[tgt].versification:
        raise ValueError(f"modules {src} and {tgt} use different versifications")
    pairs = []
    for a, b in zip(iter_verses(src, sword_path), iter_verses(tgt, sword_path), strict=True):
        if a.ref != b.ref:
            raise SwordModuleError(f"verse order differs: {a.ref} vs {b.ref}")
        if a.text and b.text:
            pairs.append((a, b))
    return tuple(pairs)


def chapter_documents(key: str, sword_path: str | None = None) -> list[list[str]]:
    """The module's non-empty chapters in order, each a list of its non-empty verses."""
    docs: list[list[str]] = []
    current: list[str] = []
    last: tuple[str, int] | None = None
    for verse in iter_verses(key, sword_path):
        if (verse.book, verse.chapter) != last and current:
            docs.append(current)
            current = []
        last = (verse.book, verse.chapter)
        if verse.text:
            current.append(verse.text)
    if current:
        docs.append(current)
    return docs
