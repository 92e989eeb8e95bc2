"""Multi-head attention on ``torch.nn.functional.scaled_dot_product_attention``.

Batch-first ``(B, T, C)``. Heads are split across tensor-parallel ranks: the fused Q/K/V
projection is column-parallel (stride 3 keeps each rank's heads whole) and the output
projection row-parallel, one all-reduce forward and one backward (Megatron-LM, Fig. 3b).
Magneto (Sub-LN) adds a LayerNorm on the concatenated heads before ``out_proj``.
Keys/values are cached per module in ``incremental_state`` for decoding.

Selective recomputation (``recompute_core``, ``--checkpoint-activations selective``;
Korthikanti et al. 2022, section 5): only the attention core ``softmax(q k^T / sqrt(d) + mask)``,
its dropout and the product with ``v`` run under a non-reentrant ``torch.utils.checkpoint``,
so backward keeps ``q, k, v`` (and the mask) instead of the ``B*h*T*S`` scores, their
dropout mask and the dropped scores (the paper's ``5as/h`` bytes per ``sbh`` in 16-bit). The
recomputation replays the default generator (``torch.utils.checkpoint``) and the
tensor-parallel tracker streams (:func:`~torchscale_fairseq.model_parallel.random.checkpoint_context`),
so attention dropout draws the same mask twice and the gradients are those without recomputation.

Under context parallelism (``context_parallel``, training and evaluation without a decoding cache)
the queries, keys and values are this rank's chunks of the sequence and causal self-attention
runs as :func:`~torchscale_fairseq.model_parallel.context_parallel.ring_attention` over the
context-parallel group (recomputed whole under selective recomputation), within documents given
the whole sequence's document ids (``--document-masking``).
"""

from __future__ import annotations

import uuid
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.context_parallel import ContextParallelGroup, ring_attention
from torchscale_fairseq.model_parallel.layers import (
    ColumnParallelLinear,
    ParallelLayerNorm,
    RowParallelLinear,
    TensorParallelGroup,
    divide,
)
from torchscale_fairseq.model_parallel.process_groups import group_size
from torchscale_fairseq.model_parallel.random import checkpoint_context, get_rng_tracker
from torchscale_fairseq.modules.document_mask import allowed_keys
from torchscale_fairseq.modules.xpos import XPos

IncrementalState = Dict[str, Dict[str, Optional[torch.Tensor]]]

# --ts-attention-backend: SDPA's kernels; "auto" lets SDPA choose per call
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
ATTENTION_BACKENDS = ("auto", *SDPA_BACKENDS)


def scaled_xavier_blocks(num_blocks: int, gain_of_block: Dict[int, float]):
    """Init for a weight stacking ``num_blocks`` square-ish blocks: Xavier-normal per
    block, block ``i`` multiplied by ``gain_of_block.get(i, 1)``."""

    def init(weight: torch.Tensor) -> None:
        for i, block in enumerate(weight.chunk(num_blocks, dim=0)):
            nn.init.xavier_normal_(block)
            block.mul_(gain_of_block.get(i, 1.0))

    return init


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], dropout_p: float,
    is_causal: bool, backend: str = "auto",
) -> torch.Tensor:
    """``dropout(softmax(q k^T / sqrt(d) + mask)) v`` on ``scaled_dot_product_attention``, the
    dropout drawn from the rank's tensor-parallel stream (its own heads); ``backend`` other than
    ``auto`` restricts SDPA to that kernel (:data:`SDPA_BACKENDS`).

    Which tensors backward keeps depends on the kernel SDPA picks. The math kernel (here:
    CPU with attention dropout) materialises the ``B*h*T*S`` scores and keeps the softmax
    output, the dropout mask and the dropped scores: selective recomputation saves those.
    Flash / memory-efficient kernels (CPU without dropout, CUDA) never store the scores, only
    the output and the ``B*h*T`` log-sum-exp, so recomputing the core there saves just those
    at the cost of one more core forward. Either way the recomputation runs the same kernel
    on the same inputs with the same generator states (default one restored by
    ``torch.utils.checkpoint``, tracker streams by ``checkpoint_context``), so the dropout
    mask and the gradients equal those without recomputation."""
    with get_rng_tracker().fork():
        if backend == "auto":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        with sdpa_kernel(SDPA_BACKENDS[backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


def recompute_attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], dropout_p: float,
    is_causal: bool, backend: str = "auto",
) -> torch.Tensor:
    """:func:`attention_core` under non-reentrant ``torch.utils.checkpoint``: backward keeps
    its inputs and runs it again. The tracker streams are replayed by ``checkpoint_context``
    where there are any (tensor parallelism); without them the default ``context_fn`` is
    left alone, the only one ``torch.compile`` (``--ts-compile``) accepts."""
    if get_rng_tracker().states:
        return checkpoint(attention_core, q, k, v, mask, dropout_p, is_causal, backend, use_reentrant=False,
                          context_fn=checkpoint_context)
    return checkpoint(attention_core, q, k, v, mask, dropout_p, is_causal, backend, use_reentrant=False)


class MultiheadAttention(nn.Module):
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        self_attention: bool = True,
        subln: bool = False,
        gain: float = 1.0,
        xpos: bool = False,
        layernorm_eps: float = 1e-5,
        tp_group: TensorParallelGroup = None,
        sequence_parallel: bool = False,
        recompute_core: bool = False,
        backend: str = "auto",
        context_parallel: Optional[ContextParallelGroup] = None,
    ) -> None:
        super().__init__()
        if backend not in ATTENTION_BACKENDS:
            raise TsConfigError(f"--ts-attention-backend {backend!r} is not an SDPA kernel: choose one of "
                                f"{', '.join(ATTENTION_BACKENDS)}")
        self.backend = backend
        if embed_dim % num_heads != 0:
            raise TsConfigError(
                f"embedding dim {embed_dim} is not divisible by {num_heads} attention heads: "
                "set --*-embed-dim to a multiple of --*-attention-heads"
            )
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.local_heads = divide(num_heads, group_size(tp_group), "number of attention heads")
        self.dropout = dropout
        self.self_attention = self_attention
        if self_attention:
            self.qkv_proj = ColumnParallelLinear(
                embed_dim, 3 * embed_dim, stride=3, init_method=scaled_xavier_blocks(3, {2: gain}),
                what="number of attention heads", tp_group=tp_group, sequence_parallel=sequence_parallel,
            )
        else:
            self.q_proj = ColumnParallelLinear(
                embed_dim, embed_dim, init_method=scaled_xavier_blocks(1, {}), what="number of attention heads",
                tp_group=tp_group, sequence_parallel=sequence_parallel,
            )
            self.kv_proj = ColumnParallelLinear(
                embed_dim, 2 * embed_dim, stride=2, init_method=scaled_xavier_blocks(2, {1: gain}),
                what="number of attention heads", tp_group=tp_group,
            )
        self.inner_attn_ln = ParallelLayerNorm(embed_dim, eps=layernorm_eps, tp_group=tp_group) if subln else None
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, init_method=scaled_xavier_blocks(1, {0: gain}),
                                          tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.xpos = XPos(self.head_dim) if xpos and self_attention else None
        self.cache_key = f"ts_attn_{uuid.uuid4().hex}"
        self.recompute_core = recompute_core
        self.context_parallel = context_parallel if self_attention else None

    def _heads(self, x: torch.Tensor, parts: int) -> Tuple[torch.Tensor, ...]:
        """``(B, T, parts * h * d)`` -> ``parts`` views ``(B, h, T, d)``. Unbinding the
        ``parts`` dimension in place makes the backward one ``stack`` straight into the
        ``(B, T, parts * h * d)`` layout of the projection's gradient (no second copy)."""
        b, t, _ = x.shape
        return tuple(y.transpose(1, 2) for y in x.view(b, t, parts, self.local_heads, self.head_dim).unbind(2))

    def forward(
        self,
        x: torch.Tensor,
        memory: Optional[torch.Tensor] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        bias: Optional[torch.Tensor] = None,
        incremental_state: Optional[IncrementalState] = None,
        offset: int = 0,
        attn_mask: Optional[torch.Tensor] = None,
        ring_document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``x`` queries; ``memory`` keys/values for cross-attention; ``key_padding_mask``
        ``(B, S)`` True at pads; ``bias`` additive ``(1|B, h, T, S)``; ``attn_mask`` additive
        ``(B, 1, T, S)`` in the compute dtype, shared by the stack's layers, causality and padding
        included (:func:`~torchscale_fairseq.modules.document_mask.document_attention_mask`; it
        supersedes ``key_padding_mask``); ``ring_document_ids`` ``(B, T_whole)``: under context
        parallelism, the whole sequence's documents (the ring masks its blocks); ``offset`` = position
        of the first query (incremental decoding). Under sequence parallelism ``x`` is this
        rank's slice of the sequence: the query projection gathers it, the output projection
        scatters it back; keys/values of ``memory`` (full) are projected as usual."""
        cache = incremental_state.get(self.cache_key) if incremental_state is not None else None
        if self.self_attention:
            q, k, v = self._heads(self.qkv_proj(x), 3)
            if self.xpos is not None:
                q = self.xpos(q, offset=offset)
                k = self.xpos(k, offset=offset, downscale=True)
            if cache is not None:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            if incremental_state is not None:
                incremental_state[self.cache_key] = {"k": k, "v": v}
        else:
            q = self._heads(self.q_proj(x), 1)[0]
            if cache is not None:
                k, v = cache["k"], cache["v"]
            else:
                k, v = self._heads(self.kv_proj(memory), 2)
                if incremental_state is not None:
                    incremental_state[self.cache_key] = {"k": k, "v": v}
        b, t, s = q.size(0), q.size(2), k.size(2)
        ring = self.context_parallel is not None and incremental_state is None
        # under context parallelism the decoder passes trailing pads only (for MoE routing; it refuses
        # left padding): they change no real token's causal attention, and the ring takes no padding mask
        mask = self._mask(t, s, None if ring else key_padding_mask, causal, bias, q.device, attn_mask)
        is_causal = True if causal and mask is None and t == s and t > 1 else False  # a bool, also for symbolic t, s
        dropout_p = self.dropout if self.training else 0.0
        if ring:
            out = self._ring_core(q, k, v, mask, causal, ring_document_ids)
        elif self.recompute_core and self.training and torch.is_grad_enabled() and incremental_state is None:
            out = recompute_attention_core(q, k, v, mask, dropout_p, is_causal, self.backend)
        else:
            out = attention_core(q, k, v, mask, dropout_p, is_causal, self.backend)
        out = out.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim)
        if self.inner_attn_ln is not None:
            out = self.inner_attn_ln(out)
        return self.out_proj(out)

    def kernel_choice(self, x: torch.Tensor, causal: bool) -> str:
        """The SDPA kernel this self-attention runs on a batch like ``x`` ``(B, T, C)`` (no padding
        mask; dropout as in this mode) on ``x``'s device and dtype: the forced one, or SDPA's own
        choice (``torch._fused_sdp_choice``; eager only)."""
        if self.backend != "auto":
            return f"{SDPA_BACKENDS[self.backend].name} (forced by --ts-attention-backend {self.backend})"
        q = x.new_empty(x.size(0), self.local_heads, x.size(1), self.head_dim)
        dropout_p = self.dropout if self.training else 0.0
        choice = SDPBackend(torch._fused_sdp_choice(q, q, q, None, dropout_p, causal)).name
        return f"{choice} (SDPA's choice; force one with --ts-attention-backend)"

    def _ring_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                   causal: bool, document_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """Causal self-attention of this rank's chunks over the context-parallel group, within the
        whole sequence's ``document_ids`` if given (module docstring)."""
        if not causal or mask is not None:
            raise TsConfigError(
                "context parallelism splits causal self-attention without masks or biases only: use "
                "--context-parallel-size 1 for bidirectional, padded or biased attention"
            )
        cp = self.context_parallel
        if self.recompute_core and self.training and torch.is_grad_enabled():
            return checkpoint(ring_attention, q, k, v, cp.group, cp.ranks, document_ids, use_reentrant=False)
        return ring_attention(q, k, v, cp.group, cp.ranks, document_ids)

    @staticmethod
    def _mask(
        t: int, s: int, key_padding_mask: Optional[torch.Tensor], causal: bool, bias: Optional[torch.Tensor],
        device: torch.device, attn_mask: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """A boolean (True = attend) or additive float mask; None when plain or ``is_causal``
        attention suffices. ``attn_mask`` (the batch's document mask) already holds causality and
        padding, so it is used as it is (plus ``bias``)."""
        if attn_mask is not None:
            return attn_mask if bias is None else bias + attn_mask
        if key_padding_mask is None and bias is None and t == s:
            return None  # plain causal (or full) attention: SDPA's is_causal path
        allowed = allowed_keys(t, s, causal, device, key_padding_mask)
        if bias is None:
            return allowed
        if allowed is None:
            return bias
        return bias.masked_fill(~allowed, float("-inf"))
