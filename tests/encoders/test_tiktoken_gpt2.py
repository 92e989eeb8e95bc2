"""``--bpe tiktoken_gpt2``: registered with fairseq, ids as ``data_prep``, lossless round trip."""

from __future__ import annotations

from argparse import Namespace

from fairseq.data import encoders

import torchscale_fairseq  # noqa: F401
from torchscale_fairseq.data import gpt2_bpe
from torchscale_fairseq.encoders.tiktoken_gpt2 import TiktokenGPT2BPE

TEXTS = ["Hello world", " leading space, café naïve — 東京 🙂", "tabs\tand  double  spaces", "<|endoftext|> is text"]


def test_registered_with_fairseq() -> None:
    bpe = encoders.build_bpe(Namespace(bpe="tiktoken_gpt2"))
    assert isinstance(bpe, TiktokenGPT2BPE)
    assert bpe.encode("Hello world") == "15496 995"


def test_ids_match_data_prep_and_round_trip() -> None:
    bpe = TiktokenGPT2BPE()
    enc = gpt2_bpe.get_gpt2_encoding()
    for text in TEXTS:
        ids = bpe.encode(text)
        assert ids == " ".join(map(str, enc.encode_ordinary_batch([text])[0]))  # data_prep's call
        assert bpe.decode(ids) == text


def test_decode_keeps_special_symbols_and_word_starts() -> None:
    bpe = TiktokenGPT2BPE()
    assert bpe.decode("15496 <unk> 995") == "Hello<unk> world"
    assert bpe.is_beginning_of_word("995") and not bpe.is_beginning_of_word("15496")
