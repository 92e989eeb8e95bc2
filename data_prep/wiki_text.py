"""Plain text from a MediaWiki XML dump (``.xml`` or ``.xml.bz2``) with a regex markup cleaner.

Only main-namespace articles are kept (no redirects, talk or meta pages). Each article
becomes a list of paragraphs: section headings are kept as their own short paragraph,
list items lose their bullets (very short ones are dropped), and the trailing reference sections (``References``,
``External links``, ``See also``...) are dropped.
"""

from __future__ import annotations

import bz2
import html
import importlib.util
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import IO

GENSIM_WIKI_RELPATH = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
GENSIM_HINT = "pip install --no-deps gensim==4.4.0"

# Sections from which on an article is only references, links or navigation.
TRAILING_SECTIONS = {
    "references", "external links", "see also", "further reading", "notes", "bibliography",
    "sources", "footnotes", "citations", "notes and references", "references and notes",
    "works cited", "literature", "external link", "related articles",
}  # fmt: skip
# Link prefixes whose whole link is dropped (media, categories, interwiki/interlanguage).
DROPPED_LINK_PREFIX = re.compile(
    r"^\s*:?\s*(file|image|media|category|wikipedia|wp|wikt|wiktionary|help|portal|template|"
    r"special|user|talk|s|q|commons|[a-z]{2,3}(-[a-z]+)?)\s*:",
    re.IGNORECASE,
)
# List items shorter than this (after cleaning) are navigation or table debris.
MIN_LIST_ITEM_WORDS = 3
# Block elements whose content is not prose.
DROPPED_ELEMENTS = (
    "ref|math|gallery|timeline|imagemap|score|syntaxhighlight|source|pre|code|chem|hiero|"
    "graph|mapframe|templatedata|references|noinclude|table|poem"
)

_COMMENT = re.compile(r"<!--.*?(-->|\Z)", re.DOTALL)
_DROPPED_BLOCK = re.compile(rf"<({DROPPED_ELEMENTS})\b[^>/]*>.*?</\1\s*>", re.DOTALL | re.IGNORECASE)
_SELF_CLOSED = re.compile(rf"<({DROPPED_ELEMENTS})\b[^>]*/>", re.IGNORECASE)
_TEMPLATE = re.compile(r"\{\{(?:(?!\{\{|\}\}).)*\}\}", re.DOTALL)
_TABLE = re.compile(r"\{\|(?:(?!\{\||\|\}).)*\|\}", re.DOTALL)
_LINK = re.compile(r"\[\[([^\[\]]*)\]\]([a-z]*)")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:|//)[^\s\]]*\s*([^\]]*)\]")
_BARE_URL = re.compile(r"https?://\S+")
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$")
_EMPHASIS = re.compile(r"'{2,}")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_EMPTY_PARENS = re.compile(r"\(\s*(?:[,;:.]\s*)*\)")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,;:.!?)])")
_SPACE_AFTER_PAREN = re.compile(r"\(\s+")
_SPACES = re.compile(r"[ \t\u00a0\u2009\u200b]+")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*")
_LETTER = re.compile(r"[^\W\d_]")
_STRAY_MARKUP = re.compile(r"\[\[|\]\]|\{\{|\}\}|\{\||\|\}")
_TABLE_OR_BROKEN = ("|", "!", "{", "}", "[", "]")


def _remove_nested(pattern: re.Pattern, text: str) -> str:
    """Remove innermost matches of ``pattern`` until none is left (handles nesting)."""
    while True:
        text, n = pattern.subn("", text)
        if n == 0:
            return text


def _replace_link(match: re.Match) -> str:
    inner, trail = match.group(1), match.group(2)
    if DROPPED_LINK_PREFIX.match(inner):
        return ""
    target, _, label = inner.partition("|")
    text = label.split("|")[-1] if label else target
    return text.strip() + trail


def _resolve_links(text: str) -> str:
    while True:
        text, n = _LINK.subn(_replace_link, text)
        if n == 0:
            return text


def _clean_line(line: str) -> str:
    line = _EXTERNAL_LINK.sub(r"\1", line)
    line = _BARE_URL.sub("", line)
    line = _EMPHASIS.sub("", line)
    line = _MAGIC_WORD.sub("", line)
    line = _SPACES.sub(" ", line)
    line = _EMPTY_PARENS.sub("", line)
    line = _SPACE_AFTER_PAREN.sub("(", line)
    line = _SPACE_BEFORE_PUNCT.sub(r"\1", line)
    return _SPACES.sub(" ", line).strip()


def clean_wikitext(wikitext: str) -> list[str]:
    """Paragraphs of plain text from one article's wiki markup."""
    text = _COMMENT.sub("", wikitext)
    text = _DROPPED_BLOCK.sub("", text)
    text = _SELF_CLOSED.sub("", text)
    text = _remove_nested(_TEMPLATE, text)
    text = _remove_nested(_TABLE, text)
    # An unclosed template or table (e.g. in a truncated article) runs to the end.
    text = re.split(r"\{\{|\{\|", text, maxsplit=1)[0]
    text = _resolve_links(text)
    text = _TAG.sub("", text)
    text = html.unescape(text)
    blocks: list[tuple[bool, str]] = []  # (is_heading, text)
    for raw in text.split("\n"):
        heading = _HEADING.match(raw.strip())
        if heading:
            title = _clean_line(heading.group(2))
            if title.lower() in TRAILING_SECTIONS:
                break
            if title:
                blocks.append((True, title))
            continue
        stripped = raw.strip()
        line = _clean_line(_LIST_MARKER.sub("", stripped))
        if not _LETTER.search(line) or line.startswith(_TABLE_OR_BROKEN):
            continue
        if _LIST_MARKER.match(stripped) and len(line.split()) < MIN_LIST_ITEM_WORDS:
            continue
        # Brackets of markup left unbalanced by the source itself are dropped.
        blocks.append((False, _STRAY_MARKUP.sub("", line)))
    # Keep a heading only when text follows it before the next heading.
    return [
        t for i, (is_heading, t) in enumerate(blocks)
        if not is_heading or (i + 1 < len(blocks) and not blocks[i + 1][0])
    ]


def find_gensim_wiki_dump() -> Path:
    """Path of the Wikipedia excerpt shipped in gensim's test data (gensim is not imported)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"gensim's Wikipedia excerpt not found: gensim is not installed; fix: {GENSIM_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GENSIM_WIKI_RELPATH
    if not path.is_file():
        raise FileNotFoundError(f"gensim's Wikipedia excerpt {path} is missing; fix: {GENSIM_HINT}")
    return path


def _open_dump(path: Path) -> IO[bytes]:
    return bz2.open(path, "rb") if path.suffix == ".bz2" else open(path, "rb")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def iter_wiki_articles(path: Path) -> Iterator[tuple[str, str]]:
    """Yield ``(title, wikitext)`` of the main-namespace, non-redirect pages of a dump."""
    with _open_dump(path) as stream:
        context = ET.iterparse(stream, events=("end",))
        for _, elem in context:
            if _local(elem.tag) != "page":
                continue
            fields = {_local(child.tag): child for child in elem}
            title = (fields["title"].text or "") if "title" in fields else ""
            ns = (fields["ns"].text or "0").strip() if "ns" in fields else "0"
            text = ""
            revision = fields.get("revision")
            if revision is not None:
                for child in revision:
                    if _local(child.tag) == "text":
                        text = child.text or ""
            elem.clear()
            if ns != "0" or "redirect" in fields or text.lstrip().upper().startswith("#REDIRECT"):
                continue
            yield title, text


def wiki_documents(path: Path, max_docs: int | None = None, min_words: int = 20) -> list[list[str]]:
    """Cleaned articles of a dump (each a list of paragraphs), skipping ones under ``min_words``."""
    docs: list[list[str]] = []
    for _, wikitext in iter_wiki_articles(path):
        paragraphs = clean_wikitext(wikitext)
        if sum(len(p.split()) for p in paragraphs) < min_words:
            continue
        docs.append(paragraphs)
        if max_docs is not None and len(docs) >= max_docs:
            break
    return docs
