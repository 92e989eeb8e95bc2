"""``ts_mlm``: BERT-style encoder-only masked LM (``--task masked_lm``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.models import FairseqEncoder, FairseqEncoderModel, register_model, register_model_architecture

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.embedding import build_token_embedding
from torchscale_fairseq.architecture.encoder import TransformerEncoder
from torchscale_fairseq.architecture.pipeline_stage import register_tied_output
from torchscale_fairseq.device_init import build_on_cpu
from torchscale_fairseq.model_parallel.attributes import mark_sharded, mark_vocab_padded
from torchscale_fairseq.model_parallel.layers import parallel_logits
from torchscale_fairseq.model_parallel.mappings import gather_from_tensor_parallel_region
from torchscale_fairseq.model_parallel.parallel_context import current_parallel_context
from torchscale_fairseq.model_parallel.process_groups import group_size
from torchscale_fairseq.models.checkpoint_checks import check_state_dict_shapes
from torchscale_fairseq.models.config import (
    TsMaskedLMConfig,
    check_document_masking,
    check_positions,
    convert_fp8_from_args,
    validate_common,
)


class MaskedLMEncoder(FairseqEncoder):
    """Encoder plus the BERT head: dense, GELU, LayerNorm, tied output embedding + bias.

    Under pipeline parallelism the head is on the last stage, with a copy of the embedding when
    the first stage is on another rank (:func:`~torchscale_fairseq.architecture.pipeline_stage.register_tied_output`);
    a stage before the last returns its hidden states."""

    def __init__(self, cfg: StackConfig, dictionary) -> None:
        super().__init__(dictionary)
        embed_tokens = build_token_embedding(len(dictionary), cfg.embed_dim, dictionary.pad(), cfg.tp_group)
        self.tp_group = cfg.tp_group
        self.encoder = TransformerEncoder(cfg, dictionary, embed_tokens)
        self.vocab_size = len(dictionary)
        # drawn on the CPU (on every stage: one RNG stream), then moved to the default device
        dense = build_on_cpu(lambda: nn.Linear(cfg.embed_dim, cfg.embed_dim))
        last = cfg.split.holds_last_stage
        self.lm_head_dense = dense if last else None
        self.lm_head_layer_norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.layernorm_eps) if last else None
        self.lm_head_bias = nn.Parameter(torch.zeros(embed_tokens.weight.size(0))) if last else None
        if last:
            mark_vocab_padded(mark_sharded(self.lm_head_bias, 0), self.vocab_size)
        register_tied_output(self, cfg.split, embed_tokens)

    def forward(self, src_tokens, src_lengths=None, features_only: bool = False,
                return_all_hiddens: bool = False, masked_tokens: Optional[torch.Tensor] = None,
                vocab_parallel_logits: bool = False, pipeline_chunk: int = 0,
                pipeline_input: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None,
                **unused):
        """Logits over the real vocabulary; with ``vocab_parallel_logits`` this rank's
        padded vocabulary slice (for the vocabulary-parallel ``masked_lm`` loss). Under pipeline
        parallelism chunk ``pipeline_chunk`` of the encoder runs on ``pipeline_input``.
        ``document_ids``: the documents of packed blocks (``--document-masking``)."""
        out = self.encoder(src_tokens, src_lengths, return_all_hiddens=return_all_hiddens,
                           pipeline_chunk=pipeline_chunk, pipeline_input=pipeline_input, document_ids=document_ids)
        x = out["encoder_out"][0]
        extra = {"inner_states": out["encoder_states"], "moe": out["moe"]}
        if features_only or not self.encoder.split.is_last(pipeline_chunk):
            return x, extra
        if masked_tokens is not None:
            x = x[masked_tokens]
        x = self.lm_head_layer_norm(F.gelu(self.lm_head_dense(x)))
        weight = (self.tied_output if self.tied_output is not None else self.encoder.embed.embed_tokens).weight
        logits = parallel_logits(x, weight, self.tp_group) + self.lm_head_bias
        if vocab_parallel_logits:
            return logits, extra
        if group_size(self.tp_group) > 1:
            logits = gather_from_tensor_parallel_region(logits, self.tp_group)
        return logits[..., : self.vocab_size], extra

    def max_positions(self) -> int:
        return self.encoder.max_positions()


@register_model("ts_mlm", dataclass=TsMaskedLMConfig)
class TsMaskedLMModel(FairseqEncoderModel):
    reads_document_ids = True  # net_input["document_ids"] of --document-masking (the streaming tasks)

    @classmethod
    def build_model(cls, args, task):
        validate_common(args)
        check_document_masking(args, getattr(task, "document_masking", False))
        check_positions(getattr(args, "tokens_per_sample", None), args.max_positions, "--tokens-per-sample", "--max-positions")
        cfg = StackConfig.from_args(args, "encoder", "encoder_only", current_parallel_context())
        model = cls(MaskedLMEncoder(cfg, task.source_dictionary))
        convert_fp8_from_args(model, args)
        return model

    def forward(self, src_tokens, src_lengths=None, **kwargs):
        return self.encoder(src_tokens, src_lengths, **kwargs)

    @property
    def pipeline_stack(self) -> TransformerEncoder:
        """The layer stack that pipeline parallelism splits into stages."""
        return self.encoder.encoder

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        check_state_dict_shapes(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


def _defaults(args, layers: int, dim: int, heads: int, ffn: int) -> None:
    args.encoder_layers = getattr(args, "encoder_layers", layers)
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", dim)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", heads)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", ffn)
    args.encoder_learned_pos = getattr(args, "encoder_learned_pos", True)


@register_model_architecture("ts_mlm", "ts_mlm_base")
def ts_mlm_base(args):
    _defaults(args, 12, 768, 12, 3072)


@register_model_architecture("ts_mlm", "ts_mlm_tiny")
def ts_mlm_tiny(args):
    _defaults(args, 2, 128, 4, 512)


@register_model_architecture("ts_mlm", "ts_mlm_large")
def ts_mlm_large(args):
    """Megatron-LM's 336M BERT: 24 layers, 1024 hidden, 16 heads, FFN 4096."""
    _defaults(args, 24, 1024, 16, 4096)
