"""A torchscale-fairseq ``ts_lm`` as a Hugging Face causal LM (``trust_remote_code=True``).

Self-contained PyTorch (no fairseq, no torchscale_fairseq): this file is copied into the
exported folder. Parameter names follow the fairseq model's (``decoder.`` becomes ``model.``,
``decoder.output_projection`` becomes ``lm_head``), so the export is a key rename.

Per layer, with ``f`` self-attention or the FFN / MoE block:
Pre-LN and Magneto ``x + f(LN(x))``; Post-LN ``LN(x + f(x))``; DeepNorm ``LN(alpha x + f(x))``.
Magneto (Sub-LN) adds a LayerNorm before the attention output projection and before ``fc2``.
Input: ``embed_scale * E[token] + P[position]`` with fairseq's positions (``pad + 1 + number of
real tokens before``), optional LayerNorm. ``E`` may be an adaptive input and ``lm_head`` an
adaptive softmax (then the logits are log-probabilities). Keys and values are cached per layer
(a ``transformers`` ``Cache``, passed as ``cache`` or ``past_key_values``) for ``generate()``.
With ``config.cross_attention`` (an encoder-decoder's decoder, ``modeling_ts_transformer.py``) every
layer also attends to the encoder output after its self-attention (:class:`TsCrossAttention`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_ts_lm import TsLMConfig


# transformers 5.24 renamed the cache of every model from ``past_key_values`` to ``cache``: generate()
# passes ``cache=`` to forward() (prepare_inputs_for_generation) and reads the output's ``cache``
# (_update_model_kwargs_for_generation), and CausalLMOutputWithPast's field is ``cache`` (5.0-5.23:
# ``past_key_values`` all three). A forward() that only took ``past_key_values`` got no cache from 5.24's
# generate(), started an empty one at every step and attended to the newest token only. forward() takes
# either name, and the output carries the cache in the field the installed CausalLMOutputWithPast declares.
def cache_field(output_class: type) -> str:
    """The name under which the installed ``transformers``' ``output_class`` carries the cache."""
    return "cache" if any(f.name == "cache" for f in dataclasses.fields(output_class)) else "past_key_values"


CACHE_FIELD = cache_field(CausalLMOutputWithPast)


def given_cache(cache: Optional[Cache], past_key_values: Optional[Cache]) -> Optional[Cache]:
    """The cache passed under either name (``cache``: transformers >= 5.24; ``past_key_values``: before)."""
    if cache is not None and past_key_values is not None:
        raise ValueError("both cache= and past_key_values= were passed: pass the cache once")
    given = past_key_values if cache is None else cache
    if given is not None and not isinstance(given, Cache):
        raise TypeError(f"the cache is a {type(given).__name__}, not a transformers Cache: pass a DynamicCache")
    return given


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``gelu`` (exact) / ``relu``; ``swiglu`` on the fused ``[gate, up]`` halves: ``silu(gate) * up``."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h) if activation == "gelu" else F.relu(h)


def absolute_positions(attention_mask: Optional[torch.Tensor], batch: int, past: int, length: int, pad: int,
                       device: torch.device) -> torch.Tensor:
    """Position ids of the ``length`` new tokens: ``pad + 1 + (real tokens before)``, ``pad`` on padding."""
    if attention_mask is None:
        return (torch.arange(past, past + length, device=device) + pad + 1).expand(batch, length)
    mask = attention_mask.long()
    return (torch.cumsum(mask, dim=1) * mask + pad)[:, -length:]


def sinusoidal_embedding(positions: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    """Vaswani et al.'s sin/cos of ``positions``, sines first, zero at the padding position."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float, device=positions.device) * -(math.log(10000) / (half - 1)))
    angles = positions.float().unsqueeze(-1) * freq
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    if dim % 2 == 1:
        table = F.pad(table, (0, 1))
    return table.masked_fill(positions.eq(pad).unsqueeze(-1), 0.0)


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of ``key_pos - query_pos``: exact below half the buckets, then log-spaced up to
    ``max_distance``; ``bidirectional`` (encoders) gives keys after the query the upper half of the buckets."""
    bucket = torch.zeros_like(relative)
    n = -relative
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    large = max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    return bucket + torch.where(n < max_exact, n, large.clamp(max=num_buckets - 1))


def xpos_rotate(x: torch.Tensor, offset: int, scale_base: float, downscale: bool) -> torch.Tensor:
    """xPos (Sun et al. 2022): rotary angles ``n / 10000^(2i/d)`` on pairs ``(x_2i, x_2i+1)``,
    scaled by ``zeta_i^(n / scale_base)`` (queries) or its inverse (keys)."""
    head_dim = x.size(-1)
    pos = torch.arange(offset, offset + x.size(-2), device=x.device, dtype=torch.float)
    zeta = (torch.arange(0, head_dim, 2, dtype=torch.float, device=x.device) + 0.4 * head_dim) / (1.4 * head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim // 2, dtype=torch.float, device=x.device) / (head_dim // 2)))
    scale = zeta[None, :] ** (pos[:, None] / scale_base)
    if downscale:
        scale = 1.0 / scale
    angles = pos[:, None] * inv_freq[None, :]
    sin = (torch.sin(angles) * scale).repeat_interleave(2, dim=-1).to(x.dtype)
    cos = (torch.cos(angles) * scale).repeat_interleave(2, dim=-1).to(x.dtype)
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


class TsAttentionBase(nn.Module):
    """Heads, attention, Sub-LN (Magneto) and the output projection shared by self- and cross-attention."""

    def __init__(self, config: TsLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.dropout = config.attention_dropout
        self.inner_attn_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.subln else None
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def heads(self, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        """``(B, T, parts * d)`` -> ``parts`` tensors ``(B, h, T, d / h)``."""
        b, t, _ = x.shape
        return tuple(y.transpose(1, 2) for y in x.view(b, t, parts, self.num_heads, self.head_dim).unbind(2))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
               is_causal: bool) -> torch.Tensor:
        """``out_proj(LN(softmax(q k^T / sqrt(d) + mask) v))`` over the concatenated heads (LN: Magneto only)."""
        b, _, t, _ = q.shape
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                             dropout_p=self.dropout if self.training else 0.0)
        out = out.transpose(1, 2).reshape(b, t, -1)
        if self.inner_attn_ln is not None:
            out = self.inner_attn_ln(out)
        return self.out_proj(out)


class TsAttention(TsAttentionBase):
    """Self-attention with a fused ``[q; k; v]`` projection, causal when ``config.causal``."""

    def __init__(self, config: TsLMConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.causal = config.causal
        self.xpos_scale_base = config.xpos_scale_base if config.xpos else None
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], cache: Optional[Cache], past: int) -> torch.Tensor:
        q, k, v = self.heads(self.qkv_proj(x), 3)
        if self.xpos_scale_base is not None:
            q = xpos_rotate(q, past, self.xpos_scale_base, downscale=False)
            k = xpos_rotate(k, past, self.xpos_scale_base, downscale=True)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        t = q.size(2)
        return self.attend(q, k, v, mask, self.causal and mask is None and t > 1 and t == k.size(2))


@dataclasses.dataclass
class TsMemory:
    """What cross-attention reads: the encoder output ``states`` ``(B, S, d)``, its key mask ``mask``
    (boolean ``(B, 1, 1, S)``, True = a real token; ``None``: no padding) and the ``EncoderDecoderCache``
    (``None``: no cache) whose cross-attention keys and values are computed once, at the first step."""

    states: torch.Tensor
    mask: Optional[torch.Tensor]
    cache: Optional[EncoderDecoderCache]


class TsCrossAttention(TsAttentionBase):
    """The decoder's attention over the encoder output: ``q_proj`` on the queries, fused ``[k; v]``
    ``kv_proj`` on the encoder output (no relative positions, no xPos, as fairseq)."""

    def __init__(self, config: TsLMConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * config.hidden_size)

    def forward(self, x: torch.Tensor, memory: TsMemory) -> torch.Tensor:
        cache = memory.cache
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            k, v = layer.keys, layer.values
        else:
            k, v = self.heads(self.kv_proj(memory.states), 2)
            if cache is not None:
                k, v = cache.cross_attention_cache.update(k, v, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
        return self.attend(self.heads(self.q_proj(x), 1)[0], k, v, memory.mask, False)


class TsFeedForward(nn.Module):
    """``fc2(act(fc1 x))``, Sub-LN on the activation under Magneto."""

    def __init__(self, config: TsLMConfig, width: Optional[int] = None) -> None:
        """``width``: the hidden width (default ``intermediate_size``; an MoE layer's shared experts)."""
        super().__init__()
        parts = 2 if config.activation == "swiglu" else 1
        width = width or config.intermediate_size
        self.activation = config.activation
        self.activation_dropout = config.activation_dropout
        self.fc1 = nn.Linear(config.hidden_size, parts * width)
        self.ffn_layernorm = nn.LayerNorm(width, eps=config.layer_norm_eps) if config.subln else None
        self.fc2 = nn.Linear(width, config.hidden_size)

    def forward(self, x: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``keep`` (real-token mask) matters only to :class:`TsMoE`, whose signature this shares."""
        h = F.dropout(activate(self.fc1(x), self.activation), self.activation_dropout, self.training)
        if self.ffn_layernorm is not None:
            h = self.ffn_layernorm(h)
        return self.fc2(h)


class TsXMoERouter(nn.Module):
    """X-MoE scores ``cos(W x, e_k) / tau`` (``tau = exp(log_temperature)``, at least 0.01);
    ``moe_router`` ``torchscale_xmoe``: TorchScale 0.3.0's gate ``(W x) . e_k / |e_k|``."""

    def __init__(self, config: TsLMConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.moe_router_dim, bias=False)
        self.expert_embeddings = nn.Parameter(torch.zeros(config.moe_expert_count, config.moe_router_dim))
        self.log_temperature = None if config.moe_router == "torchscale_xmoe" else nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = F.linear(x.float(), self.proj.weight.float())
        experts = F.normalize(self.expert_embeddings.float(), p=2.0, dim=-1, eps=1e-4)
        if self.log_temperature is None:
            return tokens @ experts.t()
        tokens = F.normalize(tokens, p=2.0, dim=-1, eps=1e-4)
        return tokens @ experts.t() / self.log_temperature.float().exp().clamp(min=0.01)


class TsLinearRouter(nn.Module):
    """Softmax-gate scores ``W_g x``."""

    def __init__(self, config: TsLMConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.moe_expert_count, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.gate.weight.float())


class TsExperts(nn.Module):
    """``E`` FFNs stored as stacked weights: ``fc1_weight`` (E, d, parts * f), ``fc2_weight`` (E, f, d)."""

    def __init__(self, config: TsLMConfig) -> None:
        super().__init__()
        e, d, f = config.moe_expert_count, config.hidden_size, config.moe_expert_ffn_dim
        parts = 2 if config.activation == "swiglu" else 1
        self.activation = config.activation
        self.eps = config.layer_norm_eps
        self.fc1_weight = nn.Parameter(torch.zeros(e, d, parts * f))
        self.fc1_bias = nn.Parameter(torch.zeros(e, parts * f))
        self.fc2_weight = nn.Parameter(torch.zeros(e, f, d))
        self.fc2_bias = nn.Parameter(torch.zeros(e, d))
        self.ln_weight = nn.Parameter(torch.ones(e, f)) if config.subln else None
        self.ln_bias = nn.Parameter(torch.zeros(e, f)) if config.subln else None

    def forward(self, rows: torch.Tensor, expert: int) -> torch.Tensor:
        h = activate(torch.addmm(self.fc1_bias[expert], rows, self.fc1_weight[expert]), self.activation)
        if self.ln_weight is not None:
            h = F.layer_norm(h, h.shape[-1:], self.ln_weight[expert], self.ln_bias[expert], self.eps)
        return torch.addmm(self.fc2_bias[expert], h, self.fc2_weight[expert])


class TsMoE(nn.Module):
    """Top-1 (Switch, gate ``p_1``) or top-k, k >= 2 (GShard, fine-grained; gates normalised over the
    kept experts) routing of the real tokens, as fairseq evaluates it: every chosen expert kept,
    capacity ``min(T, ceil(f T k / E))`` slots per expert in priority order (every first choice before
    any second choice, and so on), no dropping when ``f <= 0``; with ``expert_bias`` (auxiliary-loss-free
    balancing) the experts are chosen by ``p + bias``, the gates stay ``p``.
    ``y_t = sum_a gate_a * expert_a(x_t)`` plus the shared experts' FFN of ``x_t`` when there are any."""

    def __init__(self, config: TsLMConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.moe_expert_count, config.moe_top_k
        self.capacity_factor = config.moe_eval_capacity_factor
        self.normalize_before_dropping = config.moe_normalize_gate_prob_before_dropping
        self.router = TsLinearRouter(config) if config.moe_router == "linear" else TsXMoERouter(config)
        self.experts = TsExperts(config)
        self.shared_experts = (TsFeedForward(config, config.moe_shared_expert_count * config.moe_expert_ffn_dim)
                               if config.moe_shared_expert_count > 0 else None)
        if config.moe_router_bias:
            self.register_buffer("expert_bias", torch.zeros(config.moe_expert_count))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        index = torch.arange(flat.size(0), device=x.device) if keep is None else keep.reshape(-1).nonzero().squeeze(1)
        tokens = flat.index_select(0, index)
        n = tokens.size(0)
        probs = torch.softmax(self.router(tokens), dim=-1)
        capacity = n if self.capacity_factor <= 0 else min(n, math.ceil(self.capacity_factor * n * self.top_k
                                                                        / self.num_experts))
        if self.expert_bias is None:
            gates, experts = probs.topk(self.top_k, dim=-1)
        else:  # auxiliary-loss-free balancing: the bias chooses, the gates stay the probabilities
            experts = (probs + self.expert_bias.float()).topk(self.top_k, dim=-1).indices
            gates = probs.gather(1, experts)
        if self.top_k >= 2 and self.normalize_before_dropping:
            gates = gates / gates.sum(-1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
        token = torch.arange(n, device=x.device).repeat(self.top_k)
        expert, gate = experts.t().reshape(-1), gates.t().reshape(-1)
        slot = torch.zeros_like(expert)
        for e in range(self.num_experts):
            mine = expert.eq(e)
            slot[mine] = torch.arange(int(mine.sum()), device=x.device)
        kept = slot < capacity
        token, expert, gate = token[kept], expert[kept], gate[kept]
        if self.top_k >= 2 and not self.normalize_before_dropping:
            total = torch.zeros(n, dtype=gate.dtype, device=x.device).index_add(0, token, gate)
            gate = gate / total.clamp(min=torch.finfo(gate.dtype).eps)[token]
        out = torch.zeros_like(tokens)
        for e in expert.unique().tolist():
            mine = expert.eq(e)
            rows = self.experts(tokens.index_select(0, token[mine]), e)
            out.index_add_(0, token[mine], rows * gate[mine].to(rows.dtype).unsqueeze(1))
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return flat.new_zeros(flat.shape).index_copy(0, index, out).view_as(x)


class TsLayer(nn.Module):
    """Self-attention, cross-attention (``config.cross_attention``: an encoder-decoder's decoder), FFN / MoE."""

    def __init__(self, config: TsLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.normalize_before = config.normalize_before
        self.alpha = config.residual_alpha
        self.dropout = config.dropout
        self.self_attn = TsAttention(config, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.cross_attn = TsCrossAttention(config, layer_idx) if config.cross_attention else None
        if self.cross_attn is not None:
            self.cross_attn_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = TsMoE(config) if config.is_moe_layer(layer_idx) else TsFeedForward(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def sublayer(self, x: torch.Tensor, norm: nn.Module, fn) -> torch.Tensor:
        if self.normalize_before:
            return x + F.dropout(fn(norm(x)), self.dropout, self.training)
        return norm(x * self.alpha + F.dropout(fn(x), self.dropout, self.training))

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], keep: Optional[torch.Tensor],
                cache: Optional[Cache], past: int, memory: Optional[TsMemory] = None) -> torch.Tensor:
        x = self.sublayer(x, self.self_attn_layer_norm, lambda h: self.self_attn(h, mask, cache, past))
        if self.cross_attn is not None:
            x = self.sublayer(x, self.cross_attn_layer_norm, lambda h: self.cross_attn(h, memory))
        return self.sublayer(x, self.final_layer_norm, lambda h: self.ffn(h, keep))


def bands(cutoffs: list[int]) -> list[tuple[int, int]]:
    """The id ranges ``[c_{i-1}, c_i)`` (``c_{-1} = 0``) of band edges ``cutoffs``."""
    return list(zip([0] + cutoffs[:-1], cutoffs))


class TsAdaptiveInput(nn.Module):
    """Adaptive input (Baevski & Auli 2019, fairseq's ``AdaptiveInput``): a token of band i
    (ids ``[lo, hi)``) is ``W_i E_i[token - lo]``, ``E_i`` of dimension ``int(d // factor**i)``."""

    def __init__(self, config: TsLMConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.bands = bands(config.adaptive_input_cutoff)
        self.embeddings = nn.ModuleList()
        for i, (lo, hi) in enumerate(self.bands):
            dim = int(d // config.adaptive_input_factor**i)
            self.embeddings.append(nn.Sequential(nn.Embedding(hi - lo, dim, config.pad_token_id if i == 0 else None),
                                                 nn.Linear(dim, d, bias=False)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids -> ``(B, T, d)`` embeddings, each band's tokens through its own table."""
        out = torch.zeros(*input_ids.shape, self.embeddings[0][1].out_features, device=input_ids.device,
                          dtype=self.embeddings[0][1].weight.dtype)
        for (lo, hi), band in zip(self.bands, self.embeddings):
            mine = input_ids.ge(lo) & input_ids.lt(hi)
            if bool(mine.any()):
                out[mine] = band(input_ids[mine] - lo)
        return out


class TsAdaptiveSoftmax(nn.Module):
    """Adaptive softmax (Grave et al. 2017) as fairseq's ``AdaptiveSoftmax.get_log_prob``: with
    ``h = log_softmax(head x)`` over the ``c_0`` frequent ids then one cluster per tail band,
    ``log p(w) = h_w`` for ``w < c_0`` and ``log p(w) = h_{c_0 + i} + log_softmax(O_i drop(P_i x))_{w - c_i}``
    for ``w`` in tail band i. Tied (``tie_adaptive_weights``): the head's word rows and ``O_i``
    are the adaptive input's ``E_0`` and ``E_{i+1}``; ``tie_adaptive_proj``: ``P_i = W_{i+1}^T``.
    Parameters keep fairseq's names (``head``, ``head.class_proj`` when tied, ``tail.i.0`` = ``P_i``,
    ``tail.i.2`` = ``O_i``); the tied ones are read from the adaptive input passed to ``forward``."""

    def __init__(self, config: TsLMConfig) -> None:
        super().__init__()
        d, cutoffs = config.hidden_size, config.adaptive_softmax_cutoff
        self.cutoffs = cutoffs
        self.dropout = config.adaptive_softmax_dropout
        self.tie_weights, self.tie_proj = config.tie_adaptive_weights, config.tie_adaptive_proj
        clusters = len(cutoffs) - 1
        if self.tie_weights:
            self.head = nn.Module()
            self.head.class_proj = nn.Linear(d, clusters, bias=False)
        else:
            self.head = nn.Linear(d, cutoffs[0] + clusters, bias=False)
        self.tail = nn.ModuleList()
        for i, (lo, hi) in enumerate(bands(cutoffs)[1:]):
            dim = int(d // config.adaptive_softmax_factor ** (i + 1))
            band = nn.ModuleDict()
            if not self.tie_proj:
                band["0"] = nn.Linear(d, dim, bias=False)
            if not self.tie_weights:
                band["2"] = nn.Linear(dim, hi - lo, bias=False)
            self.tail.append(band)

    def forward(self, x: torch.Tensor, adaptive_input: Optional[TsAdaptiveInput]) -> torch.Tensor:
        """Log-probabilities over the whole vocabulary; ``adaptive_input`` holds the tied weights."""
        if self.tie_weights:
            head = torch.cat([F.linear(x, adaptive_input.embeddings[0][0].weight), self.head.class_proj(x)], dim=-1)
        else:
            head = self.head(x)
        head = torch.log_softmax(head, dim=-1)
        first = self.cutoffs[0]
        out = [head[..., :first]]
        for i, band in enumerate(self.tail):
            tied = adaptive_input.embeddings[i + 1] if self.tie_weights else None
            h = F.linear(x, tied[1].weight.t()) if self.tie_proj else band["0"](x)
            h = F.dropout(h, self.dropout, self.training)
            scores = F.linear(h, tied[0].weight) if self.tie_weights else band["2"](h)
            out.append(torch.log_softmax(scores, dim=-1) + head[..., first + i, None])
        return torch.cat(out, dim=-1)


class TsLMPreTrainedModel(PreTrainedModel):
    config_class = TsLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["TsLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Fresh weights only for parameters a checkpoint lacks (normal(0, d^-1/2) / zero / one)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.hidden_size**-0.5)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


class TsLMModel(TsLMPreTrainedModel):
    def __init__(self, config: TsLMConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = (TsAdaptiveInput(config) if config.adaptive_input_cutoff
                             else nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id))
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings + config.pad_token_id + 1, config.hidden_size,
                         config.pad_token_id)
            if config.positions == "learned" else None
        )
        self.layernorm_embedding = (nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                                    if config.layernorm_embedding else None)
        self.layers = nn.ModuleList([TsLayer(config, i) for i in range(config.num_hidden_layers)])
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.normalize_before else None
        self.rel_pos = None
        if config.rel_pos_buckets > 0:
            self.rel_pos = nn.Embedding(config.rel_pos_buckets, config.num_attention_heads)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def embed(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], past: int) -> torch.Tensor:
        """``embed_scale * E[ids] + P[positions]`` (positions after ``past`` cached tokens), optional
        LayerNorm, dropout."""
        x = self.embed_tokens(input_ids) * self.config.embed_scale
        if self.config.positions != "none":
            b, t = input_ids.shape
            positions = absolute_positions(attention_mask, b, past, t, self.padding_idx, input_ids.device)
            if self.embed_positions is not None:
                x = x + self.embed_positions(positions)
            else:
                x = x + sinusoidal_embedding(positions, self.config.hidden_size, self.padding_idx).to(x.dtype)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return F.dropout(x, self.config.dropout, self.training)

    def relative_bias(self, t: int, s: int, past: int, dtype: torch.dtype,
                      device: torch.device) -> Optional[torch.Tensor]:
        """T5's additive bias ``(1, h, t, s)`` of queries ``past .. past + t - 1`` over keys ``0 .. s - 1``
        (bidirectional buckets unless ``config.causal``); ``None`` without ``rel_pos_buckets``."""
        if self.rel_pos is None:
            return None
        q_pos = torch.arange(past, past + t, device=device)[:, None]
        k_pos = torch.arange(s, device=device)[None, :]
        buckets = relative_position_bucket(k_pos - q_pos, not self.config.causal, self.config.rel_pos_buckets,
                                           self.config.max_rel_pos)
        return self.rel_pos(buckets).permute(2, 0, 1).unsqueeze(0).to(dtype)

    def attention_mask_4d(self, attention_mask: Optional[torch.Tensor], t: int, s: int, past: int,
                          dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """Boolean (True = attend) or additive mask ``(B|1, 1|h, t, s)``; ``None`` when SDPA's causal
        path (or, for one query, no mask) suffices.
        A query always sees itself, so a left-padded row is never fully masked (as fairseq)."""
        bias = self.relative_bias(t, s, past, dtype, device)
        padded = attention_mask is not None and not bool(attention_mask.all())
        if not padded and bias is None and (past == 0 or t == 1):
            return None
        allowed = torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)[None, None]
        if padded:
            itself = torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t).triu(s - t)
            allowed = (allowed & attention_mask[:, None, None, :].bool()) | itself[None, None]
        if bias is None:
            return allowed
        return bias.masked_fill(~allowed, float("-inf"))

    def run(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor], cache: Optional[Cache],
            memory: Optional[TsMemory] = None) -> torch.Tensor:
        """Hidden states after the last layer (and final LayerNorm) of ``input_ids`` following the
        ``cache``'s tokens (``None``: no cache; else updated in place); ``memory``: cross-attention's."""
        t = input_ids.size(1)
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and attention_mask.size(1) != past + t:
            raise ValueError(f"attention_mask covers {attention_mask.size(1)} tokens, expected {past + t}")
        x = self.embed(input_ids, attention_mask, past)
        mask = self.attention_mask_4d(attention_mask, t, past + t, past, x.dtype, x.device)
        keep = attention_mask[:, -t:].bool() if attention_mask is not None and past == 0 else None
        for layer in self.layers:
            x = layer(x, mask, keep, cache, past, memory)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return x

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        use_cache: Optional[bool] = None,
        past_key_values: Optional[Cache] = None,
        **kwargs,
    ) -> tuple[torch.Tensor, Optional[Cache]]:
        """Hidden states after the last layer (and final LayerNorm) and the cache (``past_key_values``
        is the name of ``cache`` before transformers 5.24)."""
        cache = given_cache(cache, past_key_values)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        cache = cache if use_cache else None
        return self.run(input_ids, attention_mask, cache), cache


class TsHeadModel(TsLMPreTrainedModel):
    """A stack ``model`` under an output layer ``lm_head`` whose weight is tied to ``model.embed_tokens``
    (``tie_word_embeddings``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value


class TsLMForCausalLM(TsHeadModel, GenerationMixin):
    def __init__(self, config: TsLMConfig) -> None:
        super().__init__(config)
        self.model = TsLMModel(config)
        self.lm_head = (TsAdaptiveSoftmax(config) if config.adaptive_softmax_cutoff
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: int = 0,
        past_key_values: Optional[Cache] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits of the next token at every position (the last ``logits_to_keep`` if > 0; under an
        adaptive softmax, log-probabilities); with ``labels``, the mean cross-entropy of predicting
        ``labels[:, 1:]`` (-100 ignored).
        The cache goes in as ``cache`` or ``past_key_values`` and comes out under ``CACHE_FIELD``."""
        hidden, cache = self.model(input_ids, attention_mask, cache, use_cache, past_key_values)
        hidden = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        if isinstance(self.lm_head, TsAdaptiveSoftmax):
            logits = self.lm_head(hidden, self.model.embed_tokens)
        else:
            logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
