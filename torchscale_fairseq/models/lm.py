"""``ts_lm``: decoder-only language model (``--task language_modeling``)."""

from dataclasses import dataclass, field, fields
from typing import Any, List, Optional

from fairseq.models import FairseqLanguageModel, register_model, register_model_architecture
from fairseq.modules import AdaptiveInput, AdaptiveSoftmax
from torch import nn

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.decoder import TransformerDecoder
from torchscale_fairseq.architecture.embedding import build_token_embedding
from torchscale_fairseq.device_init import build_on_cpu
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.parallel_context import current_parallel_context
from torchscale_fairseq.models.checkpoint_checks import check_state_dict_shapes
from torchscale_fairseq.models.config import (
    TsLanguageModelConfig,
    check_document_masking,
    check_positions,
    convert_fp8_from_args,
    validate_common,
)
from torchscale_fairseq.modules.moe.layer import check_generation


@dataclass
class TsAdaptiveLanguageModelConfig(TsLanguageModelConfig):
    """fairseq ``transformer_lm``'s adaptive input (Baevski & Auli 2019) and adaptive softmax
    (Grave et al. 2017) flags: the vocabulary is cut into frequency bands ``[0, c1), [c1, c2), ...``
    (ids in dictionary order), band i embedded / projected at dimension ``d / factor**i``."""

    adaptive_softmax_cutoff: Optional[str] = field(
        default=None, metadata={"help": "comma separated adaptive softmax cutoffs, e.g. 2000,10000 "
                                        "(train with --criterion adaptive_loss --ddp-backend legacy_ddp)"}
    )
    adaptive_softmax_dropout: float = field(default=0.0, metadata={"help": "dropout in the tail projections"})
    adaptive_softmax_factor: float = field(default=4, metadata={"help": "dimension divisor per tail band"})
    adaptive_input: bool = field(default=False, metadata={"help": "adaptive input embeddings"})
    adaptive_input_factor: float = field(default=4, metadata={"help": "dimension divisor per input band"})
    adaptive_input_cutoff: Optional[str] = field(
        default=None, metadata={"help": "comma separated adaptive input cutoffs"}
    )
    tie_adaptive_weights: bool = field(
        default=False, metadata={"help": "tie the adaptive softmax band weights to the adaptive input's"}
    )
    tie_adaptive_proj: bool = field(
        default=False, metadata={"help": "also tie the band projections (needs --tie-adaptive-weights)"}
    )


_ADAPTIVE_DEFAULTS = {
    f.name: f.default for f in fields(TsAdaptiveLanguageModelConfig)
    if f.name not in {g.name for g in fields(TsLanguageModelConfig)}
}


def parse_cutoffs(text: Optional[str], vocab_size: int, flag: str) -> Optional[List[int]]:
    """``"2000,10000"`` -> ``[2000, 10000]``: increasing, positive, at most the vocabulary size."""
    if not text:
        return None
    try:
        cutoffs = [int(c) for c in str(text).strip("[]").split(",")]
    except ValueError:
        raise TsConfigError(f"{flag} {text!r} is not a comma separated list of integers, e.g. 2000,10000") from None
    if any(c <= 0 for c in cutoffs) or cutoffs != sorted(set(cutoffs)) or cutoffs[-1] > vocab_size:
        raise TsConfigError(
            f"{flag} {text}: cutoffs must be increasing positive integers up to the vocabulary size {vocab_size}"
        )
    return cutoffs


def check_adaptive(args: Any) -> None:
    """One-line errors for adaptive input / softmax combinations ``ts_lm`` cannot honour (after
    filling the flags' defaults into ``args`` built without them: old checkpoints, unit tests)."""
    for name, default in _ADAPTIVE_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, default)
    softmax, adaptive_input = bool(args.adaptive_softmax_cutoff), args.adaptive_input
    if (softmax or adaptive_input) and getattr(args, "model_parallel_size", 1) > 1:
        raise TsConfigError(
            "--adaptive-softmax-cutoff / --adaptive-input are not tensor-parallel: "
            "drop them or use --model-parallel-size 1"
        )
    if (softmax or adaptive_input) and getattr(args, "pipeline_model_parallel_size", 1) > 1:
        raise TsConfigError(
            "--adaptive-softmax-cutoff / --adaptive-input are not pipeline-parallel: "
            "drop them or use --pipeline-model-parallel-size 1"
        )
    if softmax and args.share_decoder_input_output_embed:
        raise TsConfigError(
            "--share-decoder-input-output-embed ties a full softmax; with --adaptive-softmax-cutoff use "
            "--adaptive-input --tie-adaptive-weights instead"
        )
    if adaptive_input and not softmax:
        raise TsConfigError("--adaptive-input in ts_lm needs --adaptive-softmax-cutoff (an adaptive output layer)")
    if args.tie_adaptive_proj and not args.tie_adaptive_weights:
        raise TsConfigError("--tie-adaptive-proj needs --tie-adaptive-weights")
    if args.tie_adaptive_weights and not (
        adaptive_input
        and args.adaptive_input_factor == args.adaptive_softmax_factor
        and (args.adaptive_input_cutoff or args.adaptive_softmax_cutoff) == args.adaptive_softmax_cutoff
    ):
        raise TsConfigError(
            "--tie-adaptive-weights needs --adaptive-input with the adaptive softmax's cutoffs and factor "
            "(--adaptive-input-cutoff = --adaptive-softmax-cutoff, --adaptive-input-factor = --adaptive-softmax-factor)"
        )


@register_model("ts_lm", dataclass=TsAdaptiveLanguageModelConfig)
class TsLanguageModel(FairseqLanguageModel):
    reads_document_ids = True  # net_input["document_ids"] of --document-masking (the streaming tasks)

    @classmethod
    def build_model(cls, args, task):
        validate_common(args)
        check_document_masking(args, getattr(task, "document_masking", False))
        check_adaptive(args)
        if getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = args.tokens_per_sample
        check_positions(args.tokens_per_sample, args.max_target_positions, "--tokens-per-sample", "--max-target-positions")
        cfg = StackConfig.from_args(args, "decoder", "decoder_only", current_parallel_context())
        dictionary = task.target_dictionary
        vocab = len(dictionary)
        softmax_cutoffs = parse_cutoffs(args.adaptive_softmax_cutoff, vocab, "--adaptive-softmax-cutoff")
        input_cutoffs = None
        if args.adaptive_input:
            input_cutoffs = parse_cutoffs(args.adaptive_input_cutoff, vocab, "--adaptive-input-cutoff") or softmax_cutoffs

        def embeddings() -> tuple[nn.Module, Optional[nn.Module]]:
            """The input embedding and fairseq's adaptive softmax, if any (tied to it or not)."""
            if args.adaptive_input:
                embed_tokens = AdaptiveInput(vocab, dictionary.pad(), cfg.embed_dim, args.adaptive_input_factor,
                                             cfg.embed_dim, input_cutoffs, 0.0, 8)
            else:
                embed_tokens = build_token_embedding(vocab, cfg.embed_dim, dictionary.pad(), cfg.tp_group)
            adaptive_softmax = None
            if softmax_cutoffs is not None:
                adaptive_softmax = AdaptiveSoftmax(
                    vocab, cfg.embed_dim, softmax_cutoffs, dropout=args.adaptive_softmax_dropout,
                    adaptive_inputs=embed_tokens if args.tie_adaptive_weights else None,
                    factor=args.adaptive_softmax_factor, tie_proj=args.tie_adaptive_proj,
                )
            return embed_tokens, adaptive_softmax

        # fairseq's adaptive modules draw on the default device: built on the CPU, then moved
        embed_tokens, adaptive_softmax = build_on_cpu(embeddings)
        model = cls(TransformerDecoder(cfg, dictionary, embed_tokens, cross_attention=False,
                                       adaptive_softmax=adaptive_softmax))
        convert_fp8_from_args(model, args)
        return model

    def forward(self, src_tokens, pipeline_chunk: int = 0, pipeline_input=None, **kwargs):
        """The decoder on ``src_tokens``; under pipeline parallelism its chunk ``pipeline_chunk`` on
        ``pipeline_input``, the previous stage's hidden states."""
        return self.decoder(src_tokens, pipeline_chunk=pipeline_chunk, pipeline_input=pipeline_input, **kwargs)

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        check_state_dict_shapes(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    @property
    def pipeline_stack(self) -> TransformerDecoder:
        """The layer stack that pipeline parallelism splits into stages."""
        return self.decoder

    def max_decoder_positions(self) -> int:
        """Asked by fairseq's ``SequenceGenerator`` when it is built, before any decoding:
        an expert-choice model is refused there with one line."""
        check_generation([self])
        return super().max_decoder_positions()


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
