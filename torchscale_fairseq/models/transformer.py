"""``ts_transformer``: encoder-decoder translation model (``--task translation``)."""

from __future__ import annotations

from fairseq.models import FairseqEncoderDecoderModel, register_model, register_model_architecture

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.decoder import TransformerDecoder
from torchscale_fairseq.architecture.embedding import build_token_embedding
from torchscale_fairseq.architecture.encoder import TransformerEncoder
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.parallel_context import current_parallel_context
from torchscale_fairseq.models.checkpoint_checks import check_state_dict_shapes
from torchscale_fairseq.models.config import TsTransformerConfig, convert_fp8_from_args, validate_common
from torchscale_fairseq.modules.moe.layer import check_generation


@register_model("ts_transformer", dataclass=TsTransformerConfig)
class TsTransformerModel(FairseqEncoderDecoderModel):
    @classmethod
    def build_model(cls, args, task):
        validate_common(args)
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        parallel = current_parallel_context()
        enc_cfg = StackConfig.from_args(args, "encoder", "encdec_encoder", parallel)
        dec_cfg = StackConfig.from_args(args, "decoder", "encdec_decoder", parallel)
        enc_embed = build_token_embedding(len(src_dict), enc_cfg.embed_dim, src_dict.pad(), enc_cfg.tp_group)
        if getattr(args, "share_all_embeddings", False):
            if src_dict != tgt_dict:
                raise TsConfigError(
                    "--share-all-embeddings needs one dictionary for source and target: "
                    "preprocess with fairseq-preprocess --joined-dictionary"
                )
            if enc_cfg.embed_dim != dec_cfg.embed_dim:
                raise TsConfigError(
                    "--share-all-embeddings needs --encoder-embed-dim equal to --decoder-embed-dim"
                )
            dec_embed = enc_embed
            dec_cfg.share_input_output_embed = True
        else:
            dec_embed = build_token_embedding(len(tgt_dict), dec_cfg.embed_dim, tgt_dict.pad(), dec_cfg.tp_group)
        encoder = TransformerEncoder(enc_cfg, src_dict, enc_embed)
        decoder = TransformerDecoder(dec_cfg, tgt_dict, dec_embed, cross_attention=True)
        model = cls(encoder, decoder)
        convert_fp8_from_args(model, args)
        return model

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        check_state_dict_shapes(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    def max_decoder_positions(self) -> int:
        """Asked by fairseq's ``SequenceGenerator`` when it is built, before any decoding:
        an expert-choice model is refused there with one line."""
        check_generation([self])
        return super().max_decoder_positions()


def _defaults(args, layers: int, dim: int, heads: int, ffn: int) -> None:
    for side in ("encoder", "decoder"):
        setattr(args, f"{side}_layers", getattr(args, f"{side}_layers", layers))
        setattr(args, f"{side}_embed_dim", getattr(args, f"{side}_embed_dim", dim))
        setattr(args, f"{side}_attention_heads", getattr(args, f"{side}_attention_heads", heads))
        setattr(args, f"{side}_ffn_embed_dim", getattr(args, f"{side}_ffn_embed_dim", ffn))


@register_model_architecture("ts_transformer", "ts_transformer_base")
def ts_transformer_base(args):
    _defaults(args, 6, 512, 8, 2048)


@register_model_architecture("ts_transformer", "ts_transformer_tiny")
def ts_transformer_tiny(args):
    _defaults(args, 2, 128, 4, 512)


@register_model_architecture("ts_transformer", "ts_transformer_large")
def ts_transformer_large(args):
    """The TorchScale paper's NMT model: 12-12 layers, 1024 hidden, 16 heads, FFN 4096."""
    _defaults(args, 12, 1024, 16, 4096)
