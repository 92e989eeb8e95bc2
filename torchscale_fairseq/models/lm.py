"""``ts_lm``: decoder-only language model (``--task language_modeling``)."""

from __future__ import annotations

from fairseq.models import FairseqLanguageModel, register_model, register_model_architecture

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.decoder import TransformerDecoder
from torchscale_fairseq.architecture.embedding import build_token_embedding
from torchscale_fairseq.models.checkpoint_checks import check_state_dict_shapes
from torchscale_fairseq.models.config import TsLanguageModelConfig, check_positions, validate_common


@register_model("ts_lm", dataclass=TsLanguageModelConfig)
class TsLanguageModel(FairseqLanguageModel):
    @classmethod
    def build_model(cls, args, task):
        validate_common(args)
        if getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = args.tokens_per_sample
        check_positions(args.tokens_per_sample, args.max_target_positions, "--tokens-per-sample", "--max-target-positions")
        cfg = StackConfig.from_args(args, "decoder", "decoder_only")
        dictionary = task.target_dictionary
        embed_tokens = build_token_embedding(len(dictionary), cfg.embed_dim, dictionary.pad())
        return cls(TransformerDecoder(cfg, dictionary, embed_tokens, cross_attention=False))

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        check_state_dict_shapes(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


def _lm_defaults(args, layers: int, dim: int, heads: int, ffn: int) -> None:
    args.decoder_layers = getattr(args, "decoder_layers", layers)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", dim)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", heads)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", ffn)


@register_model_architecture("ts_lm", "ts_lm_base")
def ts_lm_base(args):
    _lm_defaults(args, 12, 768, 12, 3072)


@register_model_architecture("ts_lm", "ts_lm_tiny")
def ts_lm_tiny(args):
    _lm_defaults(args, 2, 128, 4, 512)


@register_model_architecture("ts_lm", "ts_lm_large")
def ts_lm_large(args):
    """The TorchScale paper's LM: 12 layers, 1024 hidden, 16 heads, FFN 4096."""
    _lm_defaults(args, 12, 1024, 16, 4096)
