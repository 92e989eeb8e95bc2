"""Span masking for masked-LM pretraining (TorchScale's ``--mask-prob``/``--span-length``).

Of ``n`` maskable tokens, ``m = clamp(round(n * mask_prob), 1, max(n - 1, 1))`` are masked
in ``k = clamp(round(m / span_length), 1, n - m + 1)`` spans: the span lengths are a uniform
random composition of ``m`` into ``k`` positive parts, and the ``n - m`` kept tokens are
spread over the ``k + 1`` gaps with every inner gap at least one token, so the spans are
exactly the ``k`` maximal runs of masked tokens (mean span length ``m / k``, about
``span_length``). Masked tokens become ``<mask>`` in the source; the target holds the
original token there and padding elsewhere (fairseq's ``masked_lm`` convention).
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def span_mask_positions(n: int, mask_prob: float, span_length: float, rng: random.Random) -> list[int]:
    """The sorted masked positions among ``n`` tokens (see the module docstring)."""
    if n <= 0:
        return []
    m = min(max(round(n * mask_prob), 1), max(n - 1, 1))
    k = min(max(round(m / span_length), 1), n - m + 1)
    cuts = sorted(rng.sample(range(1, m), k - 1))
    spans = [b - a for a, b in zip([0, *cuts], [*cuts, m])]
    free = n - m - (k - 1)
    bars = sorted(rng.sample(range(free + k), k))
    gaps = [b - a - 1 for a, b in zip([-1, *bars], [*bars, free + k])]
    positions, pos = [], 0
    for i, span in enumerate(spans):
        pos += gaps[i] + (1 if i > 0 else 0)
        positions.extend(range(pos, pos + span))
        pos += span
    return positions


def mask_spans(tokens: Sequence[int], first: int, mask_idx: int, pad: int, mask_prob: float,
               span_length: float, rng: random.Random) -> tuple[list[int], list[int]]:
    """``(source, target)`` for ``tokens`` with ``tokens[first:]`` maskable."""
    source, target = list(tokens), [pad] * len(tokens)
    for p in span_mask_positions(len(tokens) - first, mask_prob, span_length, rng):
        target[first + p], source[first + p] = tokens[first + p], mask_idx
    return source, target
