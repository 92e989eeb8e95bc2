"""Dataclass configs of the ts models (flags shared by ``ts_lm``, ``ts_transformer``, ``ts_mlm``)."""


import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from omegaconf import II
from torch import nn

from torchscale_fairseq.architecture.config import CHECKPOINT_ACTIVATIONS, checkpoint_mode
from torchscale_fairseq.choices import choice
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.float8 import FP8_RECIPES, convert_to_fp8, fp8_refusal
from torchscale_fairseq.model_parallel.pipeline_schedules import SCHEDULES
from torchscale_fairseq.modules.backbone import BACKBONES, check_backbone
from torchscale_fairseq.modules.feedforward import ACTIVATIONS
from torchscale_fairseq.modules.moe.config import (
    BALANCE_SCOPES,
    CHECKPOINT_EXCHANGES,
    COMPILED_EXPERTS,
    COMPILED_ROUTING,
    EXPERT_TENSOR_PARALLEL,
    ROUTERS,
    SECOND_EXPERT_POLICIES,
)
from torchscale_fairseq.modules.multihead_attention import ATTENTION_BACKENDS

logger = logging.getLogger(__name__)

MAX_SKIPPED_UPDATES = 10  # default of --max-skipped-updates (also for non-ts models under the plugin's trainer)


@dataclass
class TsMoEConfig(FairseqDataclass):
    """X-MoE / sparse MoE flags (``torchscale_fairseq.modules.moe``)."""

    moe_expert_count: int = field(default=0, metadata={"help": "experts per MoE layer (0 = dense model)"})
    moe_freq: int = field(default=2, metadata={"help": "every moe-freq-th FFN becomes an MoE layer"})
    moe_top_k: int = field(default=2, metadata={
        "help": "experts per token, 1 to 8 (1 = Switch, 2 = GShard; more with narrower --moe-expert-ffn-dim: "
                "fine-grained experts, DeepSeekMoE; Megatron-core --moe-router-topk)"})
    moe_expert_ffn_dim: int = field(default=0, metadata={
        "help": "hidden width of each expert (0: the dense FFN's --*-ffn-embed-dim; Megatron-core "
                "--moe-ffn-hidden-size)"})
    moe_shared_expert_count: int = field(default=0, metadata={
        "help": "shared experts every token passes, as one FFN this many times --moe-expert-ffn-dim wide, added to "
                "the routed output (DeepSeekMoE; Megatron-core --moe-shared-expert-intermediate-size = count x "
                "width); 0 = none"})
    moe_expert_parallel_size: int = field(default=0, metadata={
        "help": "spread the experts over all-to-all groups of this many data-parallel ranks, replicated over the "
                "groups (it must divide the data-parallel size and the expert count; Megatron-core "
                "--expert-model-parallel-size); 0: all data-parallel ranks when the expert count is a multiple of "
                "them, else groups of expert-count ranks"})
    moe_router_bias_update_rate: float = field(default=0.0, metadata={
        "help": "auxiliary-loss-free balancing (DeepSeek-V3; Megatron-core --moe-router-bias-update-rate): a "
                "per-expert bias added to the router probabilities for the choice only, moved by this rate times "
                "sign(mean load - load) after each update; 0 = off (DeepSeek-V3: 1e-3)"})
    moe_router: ChoiceEnum(ROUTERS) = field(
        default="xmoe", metadata={"help": "xmoe (low-dim cosine router), linear (softmax gate), expert_choice, or "
                                   "torchscale_xmoe (TorchScale 0.3.0's use_xmoe gate: (W x).e/|e|, no temperature)"}
    )
    moe_router_dim: int = field(default=16, metadata={"help": "X-MoE routing dimension"})
    moe_gate_noise: float = field(default=0.0, metadata={"help": "noisy top-k std for the linear router (0 = off)"})
    moe_capacity_factor: float = field(
        default=1.25, metadata={"help": "training capacity: factor * tokens * k / E per expert (0: no dropping)"}
    )
    moe_eval_capacity_factor: float = field(
        default=0.0, metadata={"help": "validation/generation capacity factor (0: never drop)"}
    )
    moe_second_expert_policy: ChoiceEnum(SECOND_EXPERT_POLICIES) = field(
        default="random",
        metadata={"help": "top-2, as in fairseq's MoE branch and TorchScale: random (keep the second expert when "
                          "2 * g2 > U(0,1)), sampling (draw it with Gumbel noise), all; coin: keep it with "
                          "probability 1/2"},
    )
    moe_normalize_gate_prob_before_dropping: bool = field(
        default=False, metadata={"help": "normalise top-2 gates before capacity dropping (default: after)"}
    )
    moe_allow_no_balance_loss: bool = field(
        default=False, metadata={"help": "allow training MoE layers with a criterion that ignores their balance "
                                         "loss (by default an error: use a moe_* criterion)"}
    )
    moe_balance_scope: ChoiceEnum(BALANCE_SCOPES) = field(
        default="local",
        metadata={"help": "balance loss per rank and micro-batch (local, as fairseq's MoE branch and TorchScale: "
                          "N ranks train as 1 rank with --update-freq N) or over the data-parallel group's "
                          "micro-batch (global: N ranks train as 1 rank with the N batches in one)"},
    )
    moe_checkpoint_exchange: ChoiceEnum(CHECKPOINT_EXCHANGES) = field(
        default="repeat",
        metadata={"help": "with --checkpoint-activations, an MoE layer's recomputation in backward repeats its "
                          "2 all-to-alls (repeat, as Megatron-core; no extra memory) or reuses their outputs kept "
                          "from the forward pass (keep: no all-to-all in the recomputation, 2 * k * tokens * "
                          "embed-dim more activations per MoE layer)"},
    )
    moe_expert_tensor_parallel: ChoiceEnum(EXPERT_TENSOR_PARALLEL) = field(
        default="split",
        metadata={"help": "under --model-parallel-size N: split every expert's FFN over the N tensor-parallel "
                          "ranks as the dense FFN (expert memory per rank / N) or replicate whole experts on them"},
    )
    moe_compiled_routing: ChoiceEnum(COMPILED_ROUTING) = field(
        default="off",
        metadata={"help": "outside --ts-compile (which compiles the whole layer), run each MoE layer's router, "
                          "top-k, slots, gates, auxiliary losses and statistics as one torch.compile graph (on; "
                          "eagerly, off, they are about a hundred small kernels each way)"},
    )
    moe_compiled_experts: ChoiceEnum(COMPILED_EXPERTS) = field(
        default="off",
        metadata={"help": "outside --ts-compile, run each MoE layer's gather, grouped expert GEMMs, activation, "
                          "Sub-LN and weighted combine as one torch.compile graph (on; grouped expert GEMMs at "
                          "expert-parallel size 1 with whole experts; activation-checkpointed calls and "
                          "incremental decoding run eagerly)"},
    )


@dataclass
class TsCommonConfig(TsMoEConfig):
    backbone: ChoiceEnum(BACKBONES) = field(
        default="magneto", metadata={"help": "magneto (Sub-LN), deepnorm, preln or postln"}
    )
    activation_fn: ChoiceEnum(ACTIVATIONS) = field(default="gelu", metadata={"help": "activation function"})
    dropout: float = field(default=0.1, metadata={"help": "dropout probability"})
    attention_dropout: float = field(default=0.0, metadata={"help": "dropout on attention weights"})
    activation_dropout: float = field(default=0.0, metadata={"help": "dropout after the FFN activation"})
    no_scale_embedding: bool = field(default=False, metadata={"help": "do not scale embeddings by sqrt(d)"})
    layernorm_embedding: bool = field(default=False, metadata={"help": "LayerNorm after the embedding"})
    no_token_positional_embeddings: bool = field(default=False, metadata={"help": "no absolute positions"})
    rel_pos_buckets: int = field(default=0, metadata={"help": "T5 relative position bias buckets (0 = off)"})
    max_rel_pos: int = field(default=128, metadata={"help": "largest distance of the relative position buckets"})
    xpos: bool = field(default=False, metadata={"help": "xPos rotary positions in self-attention"})
    checkpoint_activations: ChoiceEnum(CHECKPOINT_ACTIVATIONS) = field(
        default="none",
        metadata={"help": "recompute activations in backward: full (the bare flag) whole layers, selective only "
                          "the attention core (softmax, attention dropout, scores x values), none",
                  "argparse_const": "full"},
    )
    ts_compile: bool = field(
        default=False, metadata={"help": "torch.compile each transformer layer (regional compilation; opt-in)"}
    )
    ts_attention_backend: ChoiceEnum(ATTENTION_BACKENDS) = field(default="auto", metadata={
        "help": "the scaled_dot_product_attention kernel: auto (SDPA chooses; one log line names its choice), "
                "flash, efficient, cudnn (CUDA only) or math (the plain PyTorch reference)"})
    fp8: ChoiceEnum(("none",) + FP8_RECIPES) = field(default="none", metadata={
        "help": "run the attention and FFN linear layers' GEMMs in FP8 through torchao's float8 training "
                "(tensorwise or rowwise scaling; layers below torchao's size rules and the output layer stay in "
                "the model's precision); needs a GPU of compute capability >= 8.9 and torchao; dense models only"})
    layernorm_eps: float = field(default=1e-5, metadata={"help": "LayerNorm epsilon"})
    sequence_parallel: bool = field(
        default=False,
        metadata={"help": "in training, split LayerNorm, dropout and residual activations along the sequence over "
                          "the tensor-parallel group (Korthikanti et al. 2022); needs --model-parallel-size > 1"},
    )
    context_parallel_size: int = field(
        default=1,
        metadata={"help": "split every sequence over this many ranks (ts_lm; chunks r and 2C-1-r of 2C per rank, "
                          "ring attention; the data-parallel size becomes world / (model-parallel x pipeline x this))"},
    )
    max_skipped_updates: int = field(
        default=MAX_SKIPPED_UPDATES,
        metadata={"help": "stop training after this many updates in a row are skipped for a non-finite gradient "
                          "norm (fp32/bf16; fp16 stops at --min-loss-scale); 0 = never"},
    )
    ts_sync_free_step: bool = field(
        default=False,
        metadata={"help": "no host sync in the training step: an update whose gradient norm is not finite is "
                          "skipped on the device by the fused optimizer kernel and counted as an update; skips and "
                          "--max-skipped-updates are checked every --log-interval updates (--optimizer ts_adamw "
                          "with its fused kernel; fp32 or --bf16)"},
    )
    ts_fused_master_step: bool = field(
        default=False,
        metadata={"help": "--bf16 with --optimizer ts_adamw: each update's fp32 masters, AdamW moments and bf16 "
                          "parameters in one Triton kernel that reads the bf16 gradients once (no fp32 gradients; "
                          "CUDA)"},
    )


@dataclass
class TsDecoderConfig(FairseqDataclass):
    decoder_embed_dim: int = field(default=512, metadata={"help": "decoder embedding dimension"})
    decoder_ffn_embed_dim: int = field(default=2048, metadata={"help": "decoder FFN dimension"})
    decoder_layers: int = field(default=6, metadata={"help": "number of decoder layers"})
    decoder_attention_heads: int = field(default=8, metadata={"help": "decoder attention heads"})
    decoder_learned_pos: bool = field(default=False, metadata={"help": "learned decoder positions"})
    decoder_normalize_before: bool = field(
        default=False, metadata={"help": "fairseq's Pre-LN flag; with ts models use --backbone preln|magneto"}
    )
    share_decoder_input_output_embed: bool = field(default=False, metadata={"help": "tie input/output embeddings"})


@dataclass
class TsEncoderConfig(FairseqDataclass):
    encoder_embed_dim: int = field(default=512, metadata={"help": "encoder embedding dimension"})
    encoder_ffn_embed_dim: int = field(default=2048, metadata={"help": "encoder FFN dimension"})
    encoder_layers: int = field(default=6, metadata={"help": "number of encoder layers"})
    encoder_attention_heads: int = field(default=8, metadata={"help": "encoder attention heads"})
    encoder_learned_pos: bool = field(default=False, metadata={"help": "learned encoder positions"})
    encoder_normalize_before: bool = field(
        default=False, metadata={"help": "fairseq's Pre-LN flag; with ts models use --backbone preln|magneto"}
    )


@dataclass
class TsOutputConfig(FairseqDataclass):
    """The decoder's output layer and loss (:mod:`torchscale_fairseq.model_parallel.linear_cross_entropy`)."""

    ts_fused_cross_entropy: bool = field(default=False, metadata={
        "help": "compute the output layer and the cross-entropy together, --ts-loss-chunk-tokens tokens at a time, "
                "never holding all tokens' vocabulary logits (fused linear + cross-entropy, as Liger-Kernel; "
                "vocabulary-parallel under --model-parallel-size); with --ts-compile the per-chunk softmax and "
                "gradient are one compiled kernel; criterions cross_entropy and moe_cross_entropy"})
    ts_loss_chunk_tokens: int = field(default=4096, metadata={
        "help": "tokens per chunk of --ts-fused-cross-entropy (memory: chunk x vocabulary x 4 bytes)"})


@dataclass
class TsPipelineConfig(FairseqDataclass):
    """Pipeline parallelism (:mod:`torchscale_fairseq.model_parallel.pipeline_parallel`)."""

    pipeline_model_parallel_size: int = field(default=1, metadata={
        "help": "split the layers (ts_lm's decoder, ts_mlm's encoder) into this many stages on as many ranks (Megatron-LM "
                "--pipeline-model-parallel-size); the --update-freq batches are the micro-batches; with "
                "data parallelism use --ddp-backend legacy_ddp"})
    virtual_pipeline_stages: int = field(default=1, metadata={
        "help": "model chunks per pipeline rank: > 1 interleaves them (interleaved 1F1B, Megatron-LM "
                "--num-virtual-stages-per-pipeline-rank); --update-freq must be a multiple of the pipeline size"})
    pipeline_layers: Optional[str] = field(default=None, metadata={
        "help": "layers of each global stage, comma separated (pipeline size x virtual stages counts, e.g. 3,5); "
                "default: an even split"})
    pipeline_schedule: ChoiceEnum(SCHEDULES) = field(default="1f1b", metadata={
        "help": "1f1b (PipeDream-Flush: at most pipeline-size micro-batches in flight; interleaved with "
                "--virtual-pipeline-stages) or gpipe (every forward, then every backward)"})


@dataclass
class TsDocumentConfig(FairseqDataclass):
    """Packed blocks with document boundaries (the streaming tasks' ``--document-masking``)."""

    reset_positions_at_documents: bool = field(default=False, metadata={
        "help": "absolute (learned or sinusoidal) positions restart at each document of a packed block; "
                "needs --document-masking (--task streaming_lm / streaming_mlm)"})


@dataclass
class TsLanguageModelConfig(TsCommonConfig, TsDecoderConfig, TsOutputConfig, TsPipelineConfig, TsDocumentConfig):
    ts_cuda_graphs: bool = field(default=False, metadata={
        "help": "capture the decoder layers' forward and backward in CUDA graphs at the first training batch's shape "
                "and replay them (a graph launch per layer and direction; other shapes and masked batches run as "
                "usual); one GPU, MoE layers with grouped expert GEMMs (bf16 on Hopper), no activation checkpointing "
                "or --amp"})
    tokens_per_sample: int = II("task.tokens_per_sample")
    max_target_positions: Optional[int] = II("task.max_target_positions")


@dataclass
class TsTransformerConfig(TsCommonConfig, TsEncoderConfig, TsDecoderConfig, TsOutputConfig):
    share_all_embeddings: bool = field(default=False, metadata={"help": "one embedding for source, target, output"})
    max_source_positions: int = II("task.max_source_positions")
    max_target_positions: int = II("task.max_target_positions")


@dataclass
class TsMaskedLMConfig(TsCommonConfig, TsEncoderConfig, TsPipelineConfig, TsDocumentConfig):
    max_positions: int = II("task.tokens_per_sample")


def validate_common(args: Any) -> None:
    """Flag combinations the ts models cannot honour: one-line errors before any work."""
    check_backbone(args.backbone)
    if getattr(args, "pipeline_model_parallel", False):
        raise TsConfigError(
            "fairseq's --pipeline-model-parallel (fairscale's single-process Pipe) does not run ts models: use "
            "--pipeline-model-parallel-size N (ts_lm, ts_mlm), one rank per stage"
        )
    for side in ("encoder", "decoder"):
        if getattr(args, f"{side}_normalize_before", False) and args.backbone in ("deepnorm", "postln"):
            raise TsConfigError(
                f"--{side}-normalize-before asks for Pre-LN but --backbone {args.backbone} is Post-LN: "
                "drop the flag or use --backbone preln (or magneto)"
            )
    if args.backbone == "deepnorm" and getattr(args, "layernorm_embedding", False):
        raise TsConfigError(
            "--backbone deepnorm cannot honour --layernorm-embedding (DeepNet's init assumes none): drop the flag"
        )
    if getattr(args, "xpos", False) and getattr(args, "rel_pos_buckets", 0) > 0:
        raise TsConfigError("--xpos and --rel-pos-buckets are two relative position schemes: choose one")
    if getattr(args, "ts_loss_chunk_tokens", 1) < 1:
        raise TsConfigError(
            f"--ts-loss-chunk-tokens {args.ts_loss_chunk_tokens} is not a positive number of tokens: use e.g. 4096"
        )
    if getattr(args, "ts_fused_cross_entropy", False) and getattr(args, "adaptive_softmax_cutoff", None):
        raise TsConfigError(
            "--ts-fused-cross-entropy fuses a full output layer, but --adaptive-softmax-cutoff replaces it: drop one"
        )
    if getattr(args, "ts_fused_cross_entropy", False) and getattr(args, "pipeline_model_parallel_size", 1) > 1:
        raise TsConfigError(
            "--ts-fused-cross-entropy does not run under --pipeline-model-parallel-size > 1 yet: drop one of the two"
        )
    backend = getattr(args, "ts_attention_backend", "auto")
    if backend in ("efficient", "cudnn") and (getattr(args, "cpu", False) or not torch.cuda.is_available()):
        raise TsConfigError(f"--ts-attention-backend {backend} is a CUDA kernel and this run is on the CPU: "
                            "use auto, flash or math")
    if getattr(args, "fp8", "none") != "none" and getattr(args, "moe_expert_count", 0) > 0:
        raise TsConfigError(
            "--fp8 does not run expert GEMMs (the MoE layers' grouped GEMMs have no FP8 path): drop --fp8 or "
            "--moe-expert-count"
        )
    # torch.compile takes no custom context_fn in torch.utils.checkpoint, and the tensor-parallel
    # stream replay is one: full recomputation always passes it, selective only under TP
    recompute = checkpoint_mode(getattr(args, "checkpoint_activations", "none"))
    if getattr(args, "ts_compile", False) and (
        recompute == "full" or (recompute == "selective" and getattr(args, "model_parallel_size", 1) > 1)
    ):
        raise TsConfigError(
            f"--ts-compile cannot compile the dropout-stream replay of --checkpoint-activations {recompute}"
            f"{' under tensor parallelism' if recompute == 'selective' else ''}: drop one of the two flags"
            f"{'' if recompute == 'selective' else ' or use --checkpoint-activations selective'}"
        )
    for part in ("routing", "experts"):
        if getattr(args, "ts_compile", False) and getattr(args, f"moe_compiled_{part}", "off") == "on":
            logger.info(f"--moe-compiled-{part} on adds nothing to --ts-compile, which compiles each MoE layer "
                        f"whole, its {part} included")


def convert_fp8_from_args(model: nn.Module, args: Any) -> None:
    """``--fp8 RECIPE``: the model's eligible linear layers get FP8 GEMMs
    (:func:`~torchscale_fairseq.model_parallel.float8.convert_to_fp8`), refused in one line on a
    device without FP8 or without torchao; one log line names what was converted."""
    recipe = choice(args, "fp8", "none")
    if recipe == "none":
        return
    cuda = torch.cuda.is_available() and not getattr(args, "cpu", False)
    refusal = fp8_refusal("cuda" if cuda else "cpu", torch.cuda.get_device_capability() if cuda else None)
    if refusal:
        raise TsConfigError(refusal)
    converted = convert_to_fp8(model, recipe)
    logger.info("--fp8 %s: %d linear layers run FP8 GEMMs (torchao), the others stay in the model's precision "
                "(torchao's size rules): %s", recipe, len(converted), ", ".join(converted) or "none")


def check_positions(requested: int, maximum: int, requested_flag: str, maximum_flag: str) -> None:
    if requested is not None and maximum is not None and requested > maximum:
        raise TsConfigError(
            f"{requested_flag} {requested} is longer than the model's {maximum_flag} {maximum}: "
            f"lower {requested_flag} or raise {maximum_flag}"
        )


def check_document_masking(args: Any, document_masking: bool) -> None:
    """One-line errors for ``--reset-positions-at-documents`` (the model's) where it cannot work;
    ``document_masking``: the task's blocks carry ``document_ids`` (``--document-masking``)."""
    if getattr(args, "reset_positions_at_documents", False):
        if not document_masking:
            raise TsConfigError(
                "--reset-positions-at-documents needs blocks that carry their documents: add --document-masking "
                "with --task streaming_lm or streaming_mlm (fairseq's TokenBlockDataset keeps no document boundaries)"
            )
        if getattr(args, "no_token_positional_embeddings", False):
            raise TsConfigError(
                "--reset-positions-at-documents restarts absolute positions, and this model has none (xPos and the "
                "relative bias depend only on i - j, already within a document under --document-masking): drop the flag"
            )
