"""GPT-2 BPE (tiktoken built from whisper's ranks file) against published GPT-2 token ids."""

from __future__ import annotations

import importlib.util

import pytest

from torchscale_fairseq.data import gpt2_bpe

# Published GPT-2 ids (tiktoken's own test_simple, and the GPT-2 vocabulary).
KNOWN_IDS = {
    "Hello world": [15496, 995],
    " Hello world": [18435, 995],
    "hello world": [31373, 995],
    "0": [15],
    "00": [405],
    "000": [830],
    "0000": [2388],
}


@pytest.mark.parametrize("text, ids", KNOWN_IDS.items())
def test_known_gpt2_ids(text: str, ids: list[int]) -> None:
    assert gpt2_bpe.encode(text) == ids
    assert gpt2_bpe.decode(ids) == text


def test_vocabulary_size_and_endoftext() -> None:
    enc = gpt2_bpe.get_gpt2_encoding()
    assert enc.n_vocab == 50257
    assert enc.eot_token == 50256
    assert gpt2_bpe.get_gpt2_encoding() is enc  # built once


def test_endoftext_special_handling() -> None:
    assert gpt2_bpe.encode("hello <|endoftext|>", allowed_special={"<|endoftext|>"}) == [31373, 220, 50256]
    assert gpt2_bpe.encode("hello <|endoftext|>", allowed_special="all") == [31373, 220, 50256]
    with pytest.raises(ValueError):
        gpt2_bpe.encode("hello <|endoftext|>")
    # As ordinary text: "<", "|", "end", "of", "text", "|", ">".
    assert gpt2_bpe.encode("<|endoftext|>", disallowed_special=()) == [27, 91, 437, 1659, 5239, 91, 29]
    assert gpt2_bpe.decode([50256]) == "<|endoftext|>"


def test_round_trip_unicode() -> None:
    text = "Zürich, 東京 and naïve café — “quoted” 🙂\ttab  double  space\nnew line "
    assert gpt2_bpe.decode(gpt2_bpe.encode(text)) == text


def test_ranks_file_is_found_without_importing_whisper() -> None:
    path = gpt2_bpe.find_gpt2_ranks_file()
    assert path.name == "gpt2.tiktoken" and path.parent.name == "assets" and path.is_file()
    assert importlib.util.find_spec("whisper") is not None


@pytest.fixture
def fresh_cache():
    gpt2_bpe.get_gpt2_encoding.cache_clear()
    yield
    gpt2_bpe.get_gpt2_encoding.cache_clear()


def test_missing_package_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, fresh_cache: None) -> None:
    monkeypatch.setattr(gpt2_bpe.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(gpt2_bpe.GPT2AssetError) as err:
        gpt2_bpe.get_gpt2_encoding()
    message = str(err.value)
    assert "\n" not in message and "pip install --no-deps openai-whisper==20250625" in message


def test_missing_file_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, fresh_cache: None, tmp_path) -> None:
    missing = tmp_path / "whisper" / "assets" / "gpt2.tiktoken"
    monkeypatch.setattr(gpt2_bpe, "find_gpt2_ranks_file", lambda: missing)
    with pytest.raises(gpt2_bpe.GPT2AssetError, match="is missing") as err:
        gpt2_bpe.get_gpt2_encoding()
    assert str(missing) in str(err.value) and "openai-whisper==20250625" in str(err.value)


def test_bad_checksum_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, fresh_cache: None, tmp_path) -> None:
    corrupt = tmp_path / "gpt2.tiktoken"
    corrupt.write_bytes(b"SGVsbG8= 0\n")
    monkeypatch.setattr(gpt2_bpe, "find_gpt2_ranks_file", lambda: corrupt)
    # With TIKTOKEN_CACHE_DIR="" tiktoken itself would not check the hash.
    for cache_dir in ("", str(tmp_path / "cache")):
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", cache_dir)
        with pytest.raises(gpt2_bpe.GPT2AssetError, match="wrong sha256") as err:
            gpt2_bpe.get_gpt2_encoding()
    message = str(err.value)
    assert "\n" not in message and str(corrupt) in message and "openai-whisper==20250625" in message
    assert isinstance(err.value, ValueError)
