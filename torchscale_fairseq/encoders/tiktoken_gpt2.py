"""``--bpe tiktoken_gpt2``: the real GPT-2 BPE (via :mod:`torchscale_fairseq.data.gpt2_bpe`) for fairseq.

Same contract as fairseq's ``--bpe gpt2``: :meth:`encode` turns raw text into
space-separated GPT-2 ids (the symbols of the ``data_prep`` LM dictionary, where the
fairseq id is the GPT-2 id + 4), :meth:`decode` turns them back into text. Offline.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairseq.data.encoders import register_bpe
from fairseq.dataclass import FairseqDataclass

from torchscale_fairseq.data import gpt2_bpe


@dataclass
class TiktokenGPT2BPEConfig(FairseqDataclass):
    """No options: the ranks file is found offline (see ``gpt2_bpe``)."""


@register_bpe("tiktoken_gpt2", dataclass=TiktokenGPT2BPEConfig)
class TiktokenGPT2BPE:
    """GPT-2 BPE through ``tiktoken``; special tokens in the text are encoded as ordinary text."""

    def __init__(self, cfg: TiktokenGPT2BPEConfig | None = None) -> None:
        self.encoding = gpt2_bpe.get_gpt2_encoding()

    def encode(self, x: str) -> str:
        """Space-separated GPT-2 ids of ``x``."""
        return " ".join(map(str, self.encoding.encode_ordinary(x)))

    def decode(self, x: str) -> str:
        """Text of space-separated GPT-2 ids; other symbols (``<unk>``, ...) are kept verbatim."""
        pieces: list[str] = []
        ids: list[int] = []
        for tok in x.split():
            if tok.isdigit() and int(tok) < self.encoding.n_vocab:
                ids.append(int(tok))
                continue
            if ids:
                pieces.append(self.encoding.decode(ids))
                ids = []
            pieces.append(tok)
        if ids:
            pieces.append(self.encoding.decode(ids))
        return "".join(pieces)

    def is_beginning_of_word(self, x: str) -> bool:
        """Whether the token ``x`` (one GPT-2 id) starts with a space."""
        return self.decode(x).startswith(" ")
