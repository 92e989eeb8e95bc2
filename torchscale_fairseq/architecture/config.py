"""What one stack (encoder or decoder) of a ts model is made of, read from fairseq args;
handed to every module of the stack (nanoGPT's config object). ``parallel`` is the run's
:class:`~torchscale_fairseq.model_parallel.parallel_context.ParallelContext`, given by the model
builder: ``tp_group``, the tensor-parallel group the layers split over (``None``: no tensor
parallelism), and the MoE layers' expert layouts come from it. ``pipeline`` is this rank's
part of the layer stack (:class:`~torchscale_fairseq.model_parallel.pipeline_parallel.PipelineSplit`;
``None``: the whole stack). Under context parallelism (``parallel.context_size > 1``, ts_lm's
decoder only) each rank holds chunks of every sequence (:attr:`StackConfig.context_parallel`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchscale_fairseq.choices import choice
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.context_parallel import ContextParallelGroup, sequence_multiple
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.model_parallel.pipeline_parallel import PipelineSplit, parse_layer_counts
from torchscale_fairseq.modules.backbone import Backbone, build_backbone
from torchscale_fairseq.modules.feedforward import FFNSpec, check_activation
from torchscale_fairseq.modules.moe.config import moe_config_from_args

POSITIONS = ("learned", "sinusoidal", "none")
CHECKPOINT_ACTIVATIONS = ("none", "full", "selective")  # --checkpoint-activations; the bare flag means full


def checkpoint_mode(value: Any) -> str:
    """``--checkpoint-activations`` as one of :data:`CHECKPOINT_ACTIVATIONS`: ``full``
    recomputes whole layers, ``selective`` only the attention core (Korthikanti et al. 2022,
    section 5). Checkpoints saved when the flag was a boolean carry ``True`` / ``False``
    (= ``full`` / ``none``)."""
    if value is None or isinstance(value, bool):
        return "full" if value else "none"
    mode = str(value)
    if mode not in CHECKPOINT_ACTIVATIONS:
        raise TsConfigError(
            f"--checkpoint-activations {mode!r} is not a mode: choose one of {', '.join(CHECKPOINT_ACTIVATIONS)} "
            "(the bare flag means full)"
        )
    return mode


@dataclass
class StackConfig:
    embed_dim: int
    ffn_dim: int
    layers: int
    attention_heads: int
    backbone: Backbone
    max_positions: int
    positions: str = "learned"
    activation: str = "gelu"
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    scale_embedding: bool = True
    layernorm_embedding: bool = False
    rel_pos_buckets: int = 0
    max_rel_pos: int = 128
    xpos: bool = False
    reset_positions: bool = False  # absolute positions restart at each document (--reset-positions-at-documents)
    checkpoint_activations: bool = False  # recompute whole layers (--checkpoint-activations full)
    selective_recompute: bool = False  # recompute only the attention core (--checkpoint-activations selective)
    compile_layers: bool = False
    cuda_graphs: bool = False  # the decoder's layers captured in CUDA graphs in training (--ts-cuda-graphs)
    attention_backend: str = "auto"  # SDPA kernel (--ts-attention-backend)
    fused_cross_entropy: bool = False  # output layer + loss in chunks (--ts-fused-cross-entropy)
    loss_chunk_tokens: int = 4096
    layernorm_eps: float = 1e-5
    share_input_output_embed: bool = False
    moe: Any = None
    parallel: ParallelContext = field(default_factory=ParallelContext.single_process)
    sequence_parallel: bool = False
    pipeline: PipelineSplit | None = None

    @property
    def tp_group(self) -> Any:
        """The tensor-parallel group of :attr:`parallel` (``None``: a group of one)."""
        return self.parallel.tensor_group

    @property
    def context_parallel(self) -> ContextParallelGroup | None:
        """The context-parallel group the self-attention rings over (``None``: no context parallelism)."""
        p = self.parallel
        return ContextParallelGroup(p.context_group, p.context_ranks, p.context_rank) if p.context_size > 1 else None

    @property
    def sequence_multiple(self) -> int:
        """What the token ids are padded to under context parallelism (:func:`sequence_multiple`)."""
        return sequence_multiple(self.parallel.context_size, self.parallel.tensor_size, self.sequence_parallel)

    @property
    def split(self) -> PipelineSplit:
        """This rank's chunks of the layer stack (the whole stack as one chunk without a pipeline)."""
        return self.pipeline if self.pipeline is not None else PipelineSplit.whole(self.layers)

    def ffn_spec(self) -> FFNSpec:
        """The dense FFN of this stack's layers (an MoE layer's experts derive theirs from it)."""
        b = self.backbone
        return FFNSpec(self.embed_dim, self.ffn_dim, self.activation, self.activation_dropout, b.subln, b.gain,
                       self.layernorm_eps)

    @classmethod
    def from_args(cls, args: Any, side: str, part: str, parallel: ParallelContext) -> "StackConfig":
        """``side`` is ``encoder`` or ``decoder``; ``part`` one of :data:`modules.backbone.PARTS`;
        ``parallel``: the run's context."""
        positions = "none" if getattr(args, "no_token_positional_embeddings", False) else (
            "learned" if getattr(args, f"{side}_learned_pos", False) else "sinusoidal"
        )
        if side == "encoder":
            max_positions = getattr(args, "max_source_positions", None) or args.max_positions
        else:
            max_positions = args.max_target_positions
        recompute = checkpoint_mode(getattr(args, "checkpoint_activations", "none"))
        check_context_parallel(args, part, parallel)
        activation = choice(args, "activation_fn", "gelu")
        check_activation(activation)
        backbone = build_backbone(
            choice(args, "backbone", "magneto"), part, getattr(args, "encoder_layers", 0), getattr(args, "decoder_layers", 0)
        )
        return cls(
            embed_dim=getattr(args, f"{side}_embed_dim"),
            ffn_dim=getattr(args, f"{side}_ffn_embed_dim"),
            layers=getattr(args, f"{side}_layers"),
            attention_heads=getattr(args, f"{side}_attention_heads"),
            backbone=backbone,
            max_positions=max_positions,
            positions=positions,
            activation=activation,
            dropout=args.dropout,
            attention_dropout=args.attention_dropout,
            activation_dropout=args.activation_dropout,
            scale_embedding=not getattr(args, "no_scale_embedding", False),
            layernorm_embedding=getattr(args, "layernorm_embedding", False),
            rel_pos_buckets=getattr(args, "rel_pos_buckets", 0),
            max_rel_pos=getattr(args, "max_rel_pos", 128),
            xpos=getattr(args, "xpos", False),
            reset_positions=getattr(args, "reset_positions_at_documents", False),
            checkpoint_activations=recompute == "full",
            selective_recompute=recompute == "selective",
            compile_layers=getattr(args, "ts_compile", False),
            cuda_graphs=getattr(args, "ts_cuda_graphs", False),
            attention_backend=choice(args, "ts_attention_backend", "auto"),
            fused_cross_entropy=getattr(args, "ts_fused_cross_entropy", False),
            loss_chunk_tokens=getattr(args, "ts_loss_chunk_tokens", 4096),
            layernorm_eps=getattr(args, "layernorm_eps", 1e-5),
            share_input_output_embed=getattr(args, "share_decoder_input_output_embed", False),
            moe=moe_config_from_args(args),
            parallel=parallel,
            sequence_parallel=sequence_parallel_from_args(args, parallel.tensor_size),
            pipeline=pipeline_split_from_args(args, getattr(args, f"{side}_layers"), parallel),
        )


def check_context_parallel(args: Any, part: str, parallel: ParallelContext) -> None:
    """Context parallelism splits the causal self-attention of a decoder-only stack with absolute
    (or no) positions; every other case is refused in one line naming the reason."""
    size = parallel.context_size
    if size == 1:
        return
    flag = f"--context-parallel-size {size}"
    refused = [
        (part != "decoder_only", f"splits the causal self-attention of ts_lm's decoder; the {part.replace('_', ' ')} "
                                 "stack attends bidirectionally or across (not split yet)"),
        ((getattr(args, "moe_expert_count", 0) or 0) > 0 and getattr(args, "moe_router", "xmoe") == "expert_choice",
         "splits the batch each expert of --moe-router expert_choice picks its tokens from (use a token-choice router)"),
        (getattr(args, "xpos", False), "does not compose with --xpos yet (it rotates by contiguous local positions)"),
        (getattr(args, "rel_pos_buckets", 0) > 0,
         "does not compose with --rel-pos-buckets yet (the bias of every ring block would be needed)"),
        (getattr(args, "attention_dropout", 0.0) > 0, "runs its ring attention without dropout (--attention-dropout > 0)"),
    ]
    for failed, reason in refused:
        if failed:
            raise TsConfigError(f"{flag} {reason}: use --context-parallel-size 1 or drop the other option")
    tokens = getattr(args, "tokens_per_sample", None)
    if tokens is not None and tokens % (2 * size) != 0:
        raise TsConfigError(
            f"--tokens-per-sample {tokens} does not split into {2 * size} equal chunks ({flag} balances causal "
            f"attention over 2 x {size} chunks): use a multiple of {2 * size}"
        )


def sequence_parallel_from_args(args: Any, tensor_size: int) -> bool:
    """``--sequence-parallel`` at tensor-parallel size ``tensor_size``, refused in one line where it
    cannot work."""
    if not getattr(args, "sequence_parallel", False):
        return False
    if tensor_size == 1:
        raise TsConfigError(
            "--sequence-parallel splits activations over the tensor-parallel group: it needs --model-parallel-size > 1 "
            "(drop the flag or raise --model-parallel-size)"
        )
    return True


def pipeline_split_from_args(args: Any, layers: int, parallel: ParallelContext) -> PipelineSplit | None:
    """This rank's part of the stack under ``--pipeline-model-parallel-size`` (``None``: no pipeline),
    refused in one line where it cannot work."""
    size = getattr(args, "pipeline_model_parallel_size", 1) or 1
    chunks = getattr(args, "virtual_pipeline_stages", 1) or 1
    layers_flag = getattr(args, "pipeline_layers", None)
    if size == 1 and chunks == 1 and not layers_flag:
        return None
    if size == 1:
        flag = f"--virtual-pipeline-stages {chunks}" if chunks > 1 else f"--pipeline-layers {layers_flag}"
        raise TsConfigError(
            f"{flag} splits the layers of a pipeline: it needs --pipeline-model-parallel-size > 1 (drop the flag or "
            "raise the pipeline size)"
        )
    if parallel.pipeline_size != size:
        raise TsConfigError(
            f"--pipeline-model-parallel-size {size} needs a multi-process run of at least {size} ranks (this one has "
            f"{parallel.world_size}): launch them with torchrun or --distributed-world-size"
        )
    if getattr(args, "rel_pos_buckets", 0) > 0:
        raise TsConfigError(
            "--rel-pos-buckets is not pipeline-parallel yet (one bias table serves every layer, on every stage): "
            "use --xpos or learned positions, or --pipeline-model-parallel-size 1"
        )
    counts = parse_layer_counts(layers_flag)
    return PipelineSplit.for_rank(layers, size, parallel.pipeline_rank, chunks, counts)
