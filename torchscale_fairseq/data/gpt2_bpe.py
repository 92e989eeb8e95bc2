"""GPT-2 BPE (r50k_base) built offline from the ranks file shipped by ``openai-whisper``.

This is the single GPT-2 BPE code path of the project: nothing is ever downloaded.
The ranks file ``whisper/assets/gpt2.tiktoken`` is located without importing
``whisper`` (which is installed ``--no-deps`` and would not import).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Literal

import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public

from torchscale_fairseq.errors import TsConfigError

GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
ENDOFTEXT = "<|endoftext|>"
ENDOFTEXT_ID = 50256
N_VOCAB = 50257
INSTALL_HINT = "pip install --no-deps openai-whisper==20250625"

SpecialSet = Literal["all"] | Collection[str]


class GPT2AssetError(TsConfigError):
    """The GPT-2 BPE ranks file is missing or does not have the expected checksum (a ``ValueError``)."""


def find_gpt2_ranks_file() -> Path:
    """Path of ``whisper/assets/gpt2.tiktoken`` (not checked for existence)."""
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        raise GPT2AssetError(
            f"GPT-2 BPE ranks not found: package 'whisper' is not installed; fix: {INSTALL_HINT}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "assets" / "gpt2.tiktoken"


@functools.lru_cache(maxsize=1)
def get_gpt2_encoding() -> tiktoken.Encoding:
    """The GPT-2 ``tiktoken.Encoding`` (50,257 ids, ``<|endoftext|>`` = 50256), built once."""
    path = find_gpt2_ranks_file()
    if not path.is_file():
        raise GPT2AssetError(f"GPT-2 BPE ranks file {path} is missing; fix: {INSTALL_HINT}")
    # Checked here as well: tiktoken skips its own check when TIKTOKEN_CACHE_DIR is "".
    if hashlib.sha256(path.read_bytes()).hexdigest() != GPT2_TIKTOKEN_SHA256:
        raise GPT2AssetError(
            f"GPT-2 BPE ranks file {path} has a wrong sha256 (expected {GPT2_TIKTOKEN_SHA256}); "
            f"fix: {INSTALL_HINT}"
        )
    ranks = tiktoken.load.load_tiktoken_bpe(str(path), expected_hash=GPT2_TIKTOKEN_SHA256)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=tiktoken_ext.openai_public.r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: ENDOFTEXT_ID},
        explicit_n_vocab=N_VOCAB,
    )


def encode(
    text: str,
    allowed_special: SpecialSet = frozenset(),
    disallowed_special: SpecialSet = "all",
) -> list[int]:
    """GPT-2 ids of ``text``; special-token handling as in ``tiktoken.Encoding.encode``.

    By default a literal ``<|endoftext|>`` in ``text`` raises ``ValueError``; pass
    ``allowed_special={"<|endoftext|>"}`` to map it to 50256, or
    ``disallowed_special=()`` to encode it as ordinary text.
    """
    return get_gpt2_encoding().encode(
        text, allowed_special=allowed_special, disallowed_special=disallowed_special
    )


def decode(ids: Iterable[int]) -> str:
    """Text of GPT-2 ``ids`` (invalid UTF-8 byte sequences are replaced by U+FFFD)."""
    return get_gpt2_encoding().decode(list(ids))
