"""A torchscale-fairseq ``ts_mlm`` (BERT-style encoder) as a Hugging Face masked LM
(``trust_remote_code=True``).

Self-contained PyTorch (no fairseq, no torchscale_fairseq): this file is copied into the exported
folder with ``modeling_ts_lm.py``, whose blocks (embedding, layers of every backbone, X-MoE) it
runs bidirectionally. Parameter names follow the fairseq model's: ``encoder.encoder.`` becomes
``model.``, ``encoder.lm_head_dense`` / ``encoder.lm_head_layer_norm`` lose the ``encoder.`` and
``encoder.lm_head_bias`` is ``lm_head.bias``, whose weight is the token embedding (tied).

``TsMLMModel`` (``AutoModel``): the encoder's final hidden states (after the final LayerNorm of
Pre-LN / Magneto), fairseq's ``encoder_out``. ``TsMLMForMaskedLM`` (``AutoModelForMaskedLM``):
``logits = LN(gelu(W_d h + b_d)) E^T + b`` over the dictionary. Padding is ``attention_mask == 0``
or, without a mask, the ``pad_token_id`` tokens (fairseq's rule): padded tokens get position
``pad``, a zero input embedding, no expert, and are attended to by nobody.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput

from .configuration_ts_mlm import TsMLMConfig
from .modeling_ts_lm import TsHeadModel, TsLMModel, TsLMPreTrainedModel


@dataclasses.dataclass
class TsEncoderOutput(BaseModelOutput):
    """``last_hidden_state`` and ``attention_mask``, the real tokens it was computed over (1 = real):
    what an encoder-decoder's cross-attention reads when ``generate()`` passes only the encoder output."""

    attention_mask: Optional[torch.LongTensor] = None


class TsMLMPreTrainedModel(TsLMPreTrainedModel):
    config_class = TsMLMConfig


class TsMLMModel(TsMLMPreTrainedModel, TsLMModel):
    """The bidirectional encoder: :class:`TsLMModel`'s modules, no cache (loaded alone, the
    masked LM head's parameters in the folder are skipped)."""

    _keys_to_ignore_on_load_unexpected = [r"^lm_head"]

    def attention_mask_4d(self, attention_mask: Optional[torch.Tensor], t: int, s: int, past: int,
                          dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """Boolean ``(B, 1, 1, s)`` (True = a real key) or additive ``(B|1, h, t, s)`` mask; ``None``
        when nothing is padded and there is no relative position bias."""
        bias = self.relative_bias(t, s, past, dtype, device)
        if attention_mask is None or bool(attention_mask.all()):
            return bias
        allowed = attention_mask[:, None, None, :].bool()
        return allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs) -> TsEncoderOutput:
        """``last_hidden_state``: the encoder's output ``(B, T, hidden_size)``; ``attention_mask``: the real tokens."""
        real = input_ids.ne(self.padding_idx) if attention_mask is None else attention_mask.bool()
        if real.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(real.shape)}, input_ids {tuple(input_ids.shape)}")
        x = self.embed(input_ids, real.long(), 0)
        padded = not bool(real.all())
        if padded:
            x = x.masked_fill(~real.unsqueeze(-1), 0.0)
        t = input_ids.size(1)
        mask = self.attention_mask_4d(real, t, t, 0, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, mask, real if padded else None, None, 0)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return TsEncoderOutput(last_hidden_state=x, attention_mask=real.long())


class TsMLMForMaskedLM(TsMLMPreTrainedModel, TsHeadModel):
    def __init__(self, config: TsMLMConfig) -> None:
        super().__init__(config)
        self.model = TsMLMModel(config)
        self.lm_head_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.lm_head_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, **kwargs) -> MaskedLMOutput:
        """Logits ``LN(gelu(W_d h + b_d)) E^T + b`` at every position; with ``labels``, the mean
        cross-entropy over the positions whose label is not -100."""
        hidden = self.model(input_ids, attention_mask).last_hidden_state
        logits = self.lm_head(self.lm_head_layer_norm(F.gelu(self.lm_head_dense(hidden))))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)
