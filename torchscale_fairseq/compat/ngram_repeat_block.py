"""fairseq issue #5206: ``--no-repeat-ngram-size`` does nothing without fairseq's CUDA extension.
``SequenceGenerator`` hands ``NGramRepeatBlock`` the whole token buffer, padded to the maximum
length; its Python fallback ``_no_repeat_ngram`` compares the last ``n - 1`` entries of that
buffer (padding) instead of the tokens generated so far (positions ``0 .. step``), so it never
bans a token. Applies to fairseq 0.12.2 and ``fairseq-fixed`` 0.12.3.1 (same file).

We replace ``NGramRepeatBlock.forward`` so that the fallback gets ``tokens[:, : step + 1]``;
the CUDA extension (which reads the buffer up to ``step`` itself) gets the buffer as before.
The replacement is a method that calls ``self._no_repeat_ngram``, so ``torch.jit.script`` of a
``SequenceGenerator`` still compiles it, as on stock fairseq.
"""

from __future__ import annotations

from fairseq import ngram_repeat_block
from torch import Tensor


def forward(self, tokens: Tensor, lprobs: Tensor, bsz: int, beam_size: int, step: int) -> Tensor:
    """Set ``lprobs`` of each token that would repeat an n-gram of ``tokens[:, : step + 1]`` to -inf."""
    msg = f"expected {bsz * beam_size} got"
    assert tokens.size(0) == bsz * beam_size, f"{msg} {tokens.size(0)}"
    assert lprobs.size(0) == bsz * beam_size, f"{msg} {lprobs.size(0)}"
    if self.use_extension:
        return self.call_cuda_extension(tokens, lprobs, bsz, beam_size, step)
    return self._no_repeat_ngram(tokens[:, : step + 1], lprobs, bsz, beam_size, step)


def patch_ngram_repeat_block() -> None:
    ngram_repeat_block.NGramRepeatBlock.forward = forward
