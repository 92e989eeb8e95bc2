"""``--no-repeat-ngram-size`` does nothing without fairseq's CUDA extension (fairseq issue
#5206): the Python fallback of ``NGramRepeatBlock`` compares the last ``n - 1`` entries of
the whole pad-filled token buffer instead of the tokens generated so far (positions
``0 .. step``), so it never bans a token. We give the fallback those tokens only."""

from __future__ import annotations

from fairseq import ngram_repeat_block


def patch_ngram_repeat_block() -> None:
    cls = ngram_repeat_block.NGramRepeatBlock
    if getattr(cls._no_repeat_ngram, "_ts_fixed", False):
        return
    original = cls._no_repeat_ngram

    def _no_repeat_ngram(self, tokens, lprobs, bsz: int, beam_size: int, step: int):
        return original(self, tokens[:, : step + 1], lprobs, bsz, beam_size, step)

    _no_repeat_ngram._ts_fixed = True
    cls._no_repeat_ngram = _no_repeat_ngram
