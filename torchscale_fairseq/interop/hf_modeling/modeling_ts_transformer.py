"""A torchscale-fairseq ``ts_transformer`` (encoder-decoder translation model) as a Hugging Face
sequence-to-sequence LM (``AutoModelForSeq2SeqLM``, ``trust_remote_code=True``).

Self-contained PyTorch (no fairseq, no torchscale_fairseq): this file is copied into the exported
folder with ``modeling_ts_lm.py`` and ``modeling_ts_mlm.py``. The encoder is ``modeling_ts_mlm``'s
bidirectional :class:`TsMLMModel`; the decoder is ``modeling_ts_lm``'s causal stack whose layers
also attend to the encoder output (``cross_attn``: ``q_proj``, fused ``[k; v]`` ``kv_proj``, Sub-LN
under Magneto). Parameter names follow the fairseq model's: ``encoder.`` / ``decoder.`` become
``model.encoder.`` / ``model.decoder.`` (without ``embed.``), ``decoder.output_projection`` is
``lm_head``; tied embeddings (``--share-all-embeddings``, ``--share-decoder-input-output-embed``)
are stored once.

``generate()`` decodes from ``decoder_start_token_id`` (``</s>``, as fairseq), caching the decoder's
self-attention keys and values per step and the cross-attention ones once (an ``EncoderDecoderCache``,
passed as ``cache`` or ``past_key_values``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

from .configuration_ts_transformer import TsTransformerConfig
from .modeling_ts_lm import TsHeadModel, TsLMModel, TsLMPreTrainedModel, TsMemory, cache_field, given_cache
from .modeling_ts_mlm import TsMLMModel

SEQ2SEQ_CACHE_FIELD = cache_field(Seq2SeqLMOutput)


class TsTransformerPreTrainedModel(TsLMPreTrainedModel):
    config_class = TsTransformerConfig


class TsTransformerDecoder(TsTransformerPreTrainedModel, TsLMModel):
    """The causal decoder: :class:`TsLMModel`'s stack, every layer with cross-attention."""

    def forward(self, input_ids: torch.LongTensor, encoder_hidden_states: torch.Tensor,
                encoder_attention_mask: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[Cache] = None, use_cache: Optional[bool] = None,
                past_key_values: Optional[Cache] = None, **kwargs) -> tuple[torch.Tensor, Optional[EncoderDecoderCache]]:
        """Hidden states after the last layer (and final LayerNorm) and the cache (``cache`` or
        ``past_key_values``); padding of the source is ``encoder_attention_mask == 0``."""
        cache = given_cache(cache, past_key_values)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        if cache is not None and not isinstance(cache, EncoderDecoderCache):
            raise TypeError(f"the cache is a {type(cache).__name__}, not an EncoderDecoderCache: pass "
                            "EncoderDecoderCache(DynamicCache(), DynamicCache())")
        cache = cache if use_cache else None
        mask = None
        if encoder_attention_mask is not None and not bool(encoder_attention_mask.all()):
            mask = encoder_attention_mask[:, None, None, :].bool()
        memory = TsMemory(encoder_hidden_states, mask, cache)
        hidden = self.run(input_ids, attention_mask, cache.self_attention_cache if cache is not None else None, memory)
        return hidden, cache


class TsTransformerModel(TsTransformerPreTrainedModel):
    """``encoder`` (:class:`TsMLMModel`) and ``decoder`` (:class:`TsTransformerDecoder`), whose token
    embedding is the encoder's under ``share_all_embeddings``."""

    def __init__(self, config: TsTransformerConfig) -> None:
        super().__init__(config)
        self.encoder = TsMLMModel(config.encoder_config())
        self.decoder = TsTransformerDecoder(config)
        if config.share_all_embeddings:
            self._tied_weights_keys = {"decoder.embed_tokens.weight": "encoder.embed_tokens.weight"}
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.encoder.embed_tokens = value

    def get_encoder(self, *args, **kwargs) -> TsMLMModel:
        return self.encoder

    def get_decoder(self, *args, **kwargs) -> TsTransformerDecoder:
        return self.decoder


def shift_right(labels: torch.Tensor, start: int, pad: int) -> torch.Tensor:
    """fairseq's ``prev_output_tokens``: ``start`` then ``labels`` without its last token (-100 -> pad)."""
    shifted = torch.cat([torch.full_like(labels[:, :1], start), labels[:, :-1]], dim=1)
    return shifted.masked_fill(shifted.eq(-100), pad)


class TsTransformerForConditionalGeneration(TsTransformerPreTrainedModel, TsHeadModel, GenerationMixin):
    """Logits of the next target token given the source (``input_ids``) and the target so far
    (``decoder_input_ids``, starting with ``</s>``), as fairseq's ``model(src_tokens, src_lengths,
    prev_output_tokens)``."""

    def __init__(self, config: TsTransformerConfig) -> None:
        super().__init__(config)
        self.model = TsTransformerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        side = "encoder" if config.share_all_embeddings else "decoder"
        self._tied_weights_keys = {"lm_head.weight": f"model.{side}.embed_tokens.weight"}
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.decoder.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.decoder.embed_tokens = value

    def get_encoder(self, *args, **kwargs) -> TsMLMModel:
        return self.model.encoder

    def get_decoder(self, *args, **kwargs) -> TsTransformerDecoder:
        return self.model.decoder

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input_ids: Optional[torch.LongTensor] = None,
        decoder_attention_mask: Optional[torch.Tensor] = None,
        encoder_outputs: Optional[BaseModelOutput | tuple] = None,
        cache: Optional[Cache] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        past_key_values: Optional[Cache] = None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        """Logits at every target position; with ``labels`` (the target ending with ``</s>``; -100
        ignored) and no ``decoder_input_ids``, the decoder reads ``</s>`` + ``labels[:, :-1]`` and the
        loss is the mean cross-entropy of ``labels``. Padding of the source: ``attention_mask == 0``,
        else its ``pad_token_id`` tokens (the mask ``encoder_outputs`` carries). The cache goes in as
        ``cache`` or ``past_key_values``."""
        if encoder_outputs is None:
            encoder_outputs = self.model.encoder(input_ids, attention_mask)
        if attention_mask is None:  # generate() passes the encoder output alone: the mask it was computed with
            attention_mask = getattr(encoder_outputs, "attention_mask", None)
        hidden_states = encoder_outputs[0]
        if decoder_input_ids is None and labels is not None:
            decoder_input_ids = shift_right(labels, self.config.decoder_start_token_id, self.config.pad_token_id)
        hidden, cache = self.model.decoder(decoder_input_ids, hidden_states, attention_mask, decoder_attention_mask,
                                           given_cache(cache, past_key_values), use_cache)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return Seq2SeqLMOutput(loss=loss, logits=logits, encoder_last_hidden_state=hidden_states,
                               **{SEQ2SEQ_CACHE_FIELD: cache})
