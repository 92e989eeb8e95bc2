"""Expert-choice routing cannot serve autoregressive (incremental) decoding: each expert
takes its top-``C`` tokens of the whole batch, so a token's experts depend on tokens
not generated yet.

:func:`patch_build_generator` makes ``FairseqTask.build_generator`` (called by
``fairseq-generate``, ``fairseq-interactive`` and the hub interface before any decoding)
refuse a model with an expert-choice MoE layer with a one-line error
(:func:`~torchscale_fairseq.modules.moe.layer.check_generation`);
``--score-reference`` (full-sequence scoring, no decoding) is let through. The layer
itself raises the same error on an incremental forward, for callers that decode
without a generator.
"""

from __future__ import annotations

from typing import Any

from torchscale_fairseq.modules.moe.layer import check_generation


def patch_build_generator() -> None:
    """Check the models before fairseq builds a sequence generator (idempotent)."""
    from fairseq.tasks import FairseqTask

    original = FairseqTask.build_generator
    if getattr(original, "_ts_checks_routers", False):
        return

    def build_generator(self, models, args, *rest: Any, **kwargs: Any):
        if not getattr(args, "score_reference", False):
            check_generation(models)
        return original(self, models, args, *rest, **kwargs)

    build_generator._ts_checks_routers = True
    FairseqTask.build_generator = build_generator
