"""Configuration of a torchscale-fairseq ``ts_mlm`` exported for Hugging Face ``transformers``.

Copied into the exported folder with ``configuration_ts_lm.py``, whose options it shares; loaded with
``trust_remote_code=True``; it imports neither fairseq nor torchscale_fairseq.
"""

from typing import Optional

from .configuration_ts_lm import TsLMConfig


class TsMLMConfig(TsLMConfig):
    """:class:`TsLMConfig`'s options of the stack (backbone, positions, X-MoE, ...), bidirectional
    (``causal = False``: every token attends to every real token; relative positions use both
    directions' buckets); no adaptive input / softmax. ``mask_token_id``: the dictionary's
    ``<mask>`` (``None`` when the export had no dictionary)."""

    model_type = "ts_mlm"
    causal = False

    def __init__(self, mask_token_id: Optional[int] = None, use_cache: bool = False, **kwargs) -> None:
        self.mask_token_id = mask_token_id
        super().__init__(use_cache=use_cache, **kwargs)
