"""Configuration of a torchscale-fairseq ``ts_transformer`` (encoder-decoder) exported for Hugging Face
``transformers``.

Copied into the exported folder with ``configuration_ts_lm.py`` and ``configuration_ts_mlm.py``;
loaded with ``trust_remote_code=True``; it imports neither fairseq nor torchscale_fairseq.
"""

import inspect
from typing import Any, Optional

from .configuration_ts_lm import TsLMConfig
from .configuration_ts_mlm import TsMLMConfig


class TsTransformerConfig(TsLMConfig):
    """The decoder's :class:`TsLMConfig` options (causal, with cross-attention); the options shared by
    both stacks (backbone, activation, X-MoE, relative positions, xPos, dropout, ...) are the
    decoder's. ``encoder_stack``: the options in which the encoder differs (``vocab_size``,
    ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``residual_alpha``, ``positions``, ``max_position_embeddings``, ``embed_scale``).
    ``share_all_embeddings``: the encoder's token embedding is also the decoder's (and, with
    ``tie_word_embeddings``, the output layer's). Decoding starts from ``decoder_start_token_id``,
    fairseq's ``</s>``."""

    model_type = "ts_transformer"
    cross_attention = True

    def __init__(self, encoder_stack: Optional[dict[str, Any]] = None, share_all_embeddings: bool = False,
                 decoder_start_token_id: int = 2, **kwargs) -> None:
        self.encoder_stack = dict(encoder_stack or {})
        self.share_all_embeddings = share_all_embeddings
        kwargs.setdefault("is_encoder_decoder", True)
        super().__init__(decoder_start_token_id=decoder_start_token_id, **kwargs)

    def encoder_config(self) -> TsMLMConfig:
        """The bidirectional encoder's configuration: the shared options with ``encoder_stack``'s."""
        names = [n for n in inspect.signature(TsLMConfig.__init__).parameters if n not in ("self", "kwargs")]
        shared = {name: getattr(self, name) for name in names}
        return TsMLMConfig(**{**shared, **self.encoder_stack, "use_cache": False})
