"""Transformer decoder (causal), with optional cross-attention, a per-module KV cache for
incremental decoding and a vocabulary-parallel output layer, or an adaptive softmax
(Grave et al. 2017) that the criterion and ``get_normalized_probs`` apply to the features.
Its extra output carries the MoE layers' :class:`~torchscale_fairseq.modules.moe.balance.MoEAux`
under ``"moe"`` (the encoder's first, then its own).

Under pipeline parallelism a rank holds its stages' layers (``cfg.split``), the first stage the
embedding, the last the final LayerNorm and output layer (and, with tied embeddings, a copy of
the embedding; :class:`~torchscale_fairseq.architecture.pipeline_stage.PipelineStage`)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from fairseq.models import FairseqIncrementalDecoder

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.cuda_graphs import GraphedLayers, check_graphable
from torchscale_fairseq.architecture.embedding import InputEmbedding
from torchscale_fairseq.architecture.layer import TransformerLayer, wrap_layer
from torchscale_fairseq.architecture.padding_layout import INTERIOR, NONE, TRAILING, after_padding, known_padding_layout
from torchscale_fairseq.architecture.pipeline_stage import PipelineStage, register_tied_output
from torchscale_fairseq.architecture.sequence_parallel import gather_sequence, is_split, pad_document_ids, pad_tokens
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import mark_sequence_parallel, mark_vocab_padded
from torchscale_fairseq.model_parallel.context_parallel import context_parallel_indices, pad_to_multiple
from torchscale_fairseq.model_parallel.layers import ColumnParallelLinear, parallel_logits, real_rows_normal_init
from torchscale_fairseq.model_parallel.linear_cross_entropy import linear_cross_entropy
from torchscale_fairseq.model_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
)
from torchscale_fairseq.model_parallel.process_groups import group_size
from torchscale_fairseq.modules.document_mask import compute_dtype, document_attention_mask
from torchscale_fairseq.modules.moe.factory import build_ffn
from torchscale_fairseq.modules.relative_position_bias import RelativePositionBias

_STEP_KEY = "ts_decoder_step"


class TransformerDecoder(FairseqIncrementalDecoder, PipelineStage):
    def __init__(
        self, cfg: StackConfig, dictionary, embed_tokens: nn.Module, cross_attention: bool = True,
        adaptive_softmax: Optional[nn.Module] = None,
    ) -> None:
        """``adaptive_softmax`` (fairseq's ``AdaptiveSoftmax``): replaces the output projection;
        ``forward`` then returns the final features, as fairseq's ``TransformerDecoder`` does."""
        super().__init__(dictionary)
        self.cfg = cfg
        self.padding_idx = dictionary.pad()
        self.vocab_size = len(dictionary)
        embed = InputEmbedding(cfg, embed_tokens, self.padding_idx)  # (drawn first, as in one process)
        self.embed = embed if cfg.split.holds_first_stage else None
        self.layers = self.init_stage(cfg, lambda i: wrap_layer(
            TransformerLayer(cfg, cross_attention=cross_attention, ffn=build_ffn(cfg, i, f"dec{i}")), cfg))
        self.cuda_graphs = None
        if cfg.cuda_graphs:
            check_graphable(cfg)
            self.cuda_graphs = GraphedLayers(dynamic_batch=cfg.compile_layers)
        last = self.split.holds_last_stage
        self.layer_norm = (nn.LayerNorm(cfg.embed_dim, eps=cfg.layernorm_eps)
                           if cfg.backbone.normalize_before and last else None)
        if cfg.sequence_parallel and self.layer_norm is not None:
            mark_sequence_parallel(self.layer_norm.parameters())
        self.rel_pos = (
            RelativePositionBias(cfg.attention_heads, False, cfg.rel_pos_buckets, cfg.max_rel_pos, cfg.tp_group)
            if cfg.rel_pos_buckets > 0 else None
        )
        self.adaptive_softmax = adaptive_softmax
        self.output_projection = None
        if adaptive_softmax is None and not cfg.share_input_output_embed:
            projection = ColumnParallelLinear(
                cfg.embed_dim, embed_tokens.padded_num_embeddings, bias=False,
                init_method=real_rows_normal_init(self.vocab_size, cfg.embed_dim**-0.5), what="vocabulary size",
                tp_group=cfg.tp_group,
            )
            mark_vocab_padded(projection.weight, self.vocab_size)
            self.output_projection = projection if last else None
        if cfg.share_input_output_embed:
            register_tied_output(self, self.split, embed_tokens)
        else:
            self.tied_output = None

    @property
    def output_weight(self) -> torch.Tensor:
        if self.output_projection is not None:
            return self.output_projection.weight
        if self.tied_output is not None:
            return self.tied_output.weight
        return self.embed.embed_tokens.weight

    def forward(
        self,
        prev_output_tokens: torch.Tensor,
        encoder_out: Optional[Dict[str, List[torch.Tensor]]] = None,
        incremental_state: Optional[Dict[str, Any]] = None,
        features_only: bool = False,
        return_all_hiddens: bool = False,
        pipeline_chunk: int = 0,
        pipeline_input: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
        **unused,
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """``pipeline_chunk``: which of this rank's chunks runs, on ``pipeline_input`` (the previous
        stage's hidden states; ``None`` on the first stage, which embeds the tokens).
        ``document_ids`` (B, T): the documents of packed blocks; attention stays within each
        (:mod:`~torchscale_fairseq.modules.document_mask`)."""
        x, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state, return_all_hiddens,
                                         pipeline_chunk, pipeline_input, document_ids)
        if not features_only and self.split.is_last(pipeline_chunk):
            x = self.output_layer(x)
        return x, extra

    def extract_features(
        self,
        prev_output_tokens: torch.Tensor,
        encoder_out: Optional[Dict[str, List[torch.Tensor]]] = None,
        incremental_state: Optional[Dict[str, Any]] = None,
        return_all_hiddens: bool = False,
        pipeline_chunk: int = 0,
        pipeline_input: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
        **unused,
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        chunk = pipeline_chunk
        incremental = incremental_state is not None and _STEP_KEY in incremental_state
        offset = prev_output_tokens.size(1) - 1 if incremental else 0
        length = prev_output_tokens.size(1)
        split = is_split(self.cfg, self.training)
        layout = known_padding_layout(prev_output_tokens)  # found on the host (padding_layout.py), else tested here
        context, context_index, ring_documents = self.cfg.context_parallel, None, None
        if context is not None and incremental_state is None:
            whole = pad_to_multiple(prev_output_tokens, self.cfg.sequence_multiple, self.padding_idx)
            layout = after_padding(layout, whole.size(1) != length) if self.cfg.moe is None else None
            context_index = context_parallel_indices(whole.size(1), context.size, context.rank, whole.device)
            if document_ids is not None:  # the ring masks its blocks by document: no (T, T) mask
                ring_documents = pad_to_multiple(document_ids, self.cfg.sequence_multiple, -1)
                document_ids = None
            x = (self.embed(whole, context_index=context_index, document_ids=ring_documents)
                 if self.split.is_first(chunk) else pipeline_input)
            prev_output_tokens = whole[:, context_index]
            length = prev_output_tokens.size(1)
        else:
            if split:
                prev_output_tokens = pad_tokens(prev_output_tokens, self.cfg, self.padding_idx)
                layout = after_padding(layout, prev_output_tokens.size(1) != length)
                document_ids = pad_document_ids(document_ids, self.cfg) if document_ids is not None else None
            if incremental:
                document_ids = None
            x = (self.embed(prev_output_tokens, last_only=incremental, document_ids=document_ids)
                 if self.split.is_first(chunk) else pipeline_input)
        if incremental_state is not None:
            incremental_state[_STEP_KEY] = {"step": None}
        padding_mask = None
        if not incremental:
            pads = prev_output_tokens.eq(self.padding_idx)
            # causal: trailing pads change no real token's output (the loss ignores pad targets);
            # only a pad followed by a real token (left padding), or MoE routing, needs the mask
            if context_index is not None:  # the ring has no mask: the whole sequence (every rank's) is checked
                every = whole.eq(self.padding_idx)
                if layout == INTERIOR or (layout is None and bool((every[:, :-1] & ~every[:, 1:]).any())):
                    raise TsConfigError(
                        "context parallelism runs causal attention without a padding mask, but this batch has a pad "
                        "before a real token (left padding): right-pad the batch or use --context-parallel-size 1"
                    )
            if layout is not None:
                needed = layout == INTERIOR or (layout == TRAILING and self.cfg.moe is not None)
            else:
                needed = bool((pads if self.cfg.moe is not None else pads[:, :-1] & ~pads[:, 1:]).any())
            if needed:
                padding_mask = pads
        attn_mask = (document_attention_mask(document_ids, True, compute_dtype(x), padding_mask)
                     if document_ids is not None else None)
        if self.cfg.compile_layers and not incremental:  # one graph for every batch size
            torch._dynamo.maybe_mark_dynamic(x, 0)
            for mask in (padding_mask, attn_mask):
                if mask is not None:
                    torch._dynamo.maybe_mark_dynamic(mask, 0)
        t = 1 if incremental else prev_output_tokens.size(1)
        bias = self.rel_pos(t, offset + t, offset) if self.rel_pos is not None else None
        memory = memory_mask = None
        if encoder_out is not None and len(encoder_out.get("encoder_out", [])) > 0:
            memory = encoder_out["encoder_out"][0]
            mask = encoder_out["encoder_padding_mask"][0] if encoder_out.get("encoder_padding_mask") else None
            known = known_padding_layout(mask) if mask is not None else None
            memory_mask = mask if mask is not None and (known != NONE if known else bool(mask.any())) else None
        states = [x] if return_all_hiddens else []
        moe = list(encoder_out.get("moe", [])) if encoder_out is not None else []
        layers = self.chunk_layers(chunk)
        self.log_attention_kernel(layers, x, causal=True)
        if self.cuda_graphs is not None and incremental_state is None and not return_all_hiddens and all(
                t is None for t in (padding_mask, attn_mask, bias, memory, ring_documents)):
            graphed = self.cuda_graphs(layers, x)
            if graphed is not None:
                (x, graphed_moe), layers = graphed, []
                moe.extend(graphed_moe)
        for layer in layers:
            x, aux = layer(
                x, padding_mask=padding_mask, causal=True, self_attn_bias=bias, memory=memory,
                memory_padding_mask=memory_mask, incremental_state=incremental_state, offset=offset,
                self_attn_mask=attn_mask, ring_document_ids=ring_documents,
            )
            if aux is not None:
                moe.append(aux)
            if return_all_hiddens:
                states.append(x)
        if self.split.is_last(chunk):
            if self.layer_norm is not None:
                x = self.layer_norm(x)
            if split:
                x = gather_sequence(x, self.cfg, length)
        return x, {"attn": [None], "inner_states": states, "moe": moe}

    def output_layer(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over this rank's vocabulary slice (the whole vocabulary at size 1); the
        features themselves under an adaptive softmax (it projects them per cluster)."""
        if self.adaptive_softmax is not None:
            return features
        return parallel_logits(features, self.output_weight, self.cfg.tp_group)

    @property
    def fuses_output_loss(self) -> bool:
        """Whether criterions call :meth:`output_loss` on the features (``--ts-fused-cross-entropy``)."""
        return self.cfg.fused_cross_entropy and self.adaptive_softmax is None

    def output_loss(self, features: torch.Tensor, target: torch.Tensor, ignore_index: Optional[int]) -> torch.Tensor:
        """Summed cross-entropy of :meth:`output_layer` ``(features)`` against ``target``, padded
        vocabulary entries excluded, without the full logits (:func:`linear_cross_entropy`)."""
        hidden = copy_to_tensor_parallel_region(features, self.cfg.tp_group)
        with torch.profiler.record_function("ts_loss"):  # the loss's row in benchmarks/train_profile.py
            return linear_cross_entropy(
                hidden.reshape(-1, hidden.size(-1)), self.output_weight, target.reshape(-1), self.vocab_size,
                ignore_index, self.cfg.loss_chunk_tokens, self.cfg.tp_group, self.cfg.compile_layers)

    def get_normalized_probs(self, net_output, log_probs: bool, sample=None) -> torch.Tensor:
        """(Log-)probabilities over the real vocabulary; tensor-parallel slices are gathered
        and the padded vocabulary entries dropped, so they are never predicted. Under an adaptive
        softmax, log p(w) = log p(cluster(w)) + log p(w | cluster), for every word or, given
        ``sample["target"]``, only for the clusters of the targets (fairseq's ``get_log_prob``)."""
        if self.adaptive_softmax is not None:
            target = sample["target"] if sample is not None else None
            log_p = self.adaptive_softmax.get_log_prob(net_output[0], target=target)
            return log_p if log_probs else log_p.exp()
        logits = net_output[0]
        if group_size(self.cfg.tp_group) > 1:
            logits = gather_from_tensor_parallel_region(logits, self.cfg.tp_group)
        if logits.size(-1) != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        logits = logits.float()
        return torch.log_softmax(logits, dim=-1) if log_probs else torch.softmax(logits, dim=-1)

    def reorder_incremental_state(self, incremental_state: Dict[str, Any], new_order: torch.Tensor) -> None:
        for key, cache in incremental_state.items():
            if key.startswith("ts_attn_"):
                for name, value in cache.items():
                    if value is not None:
                        cache[name] = value.index_select(0, new_order)

    def max_positions(self) -> int:
        return self.cfg.max_positions

