"""Configuration of a torchscale-fairseq ``ts_lm`` exported for Hugging Face ``transformers``.

Self-contained: this file is copied into the exported folder and loaded with
``trust_remote_code=True``; it imports neither fairseq nor torchscale_fairseq.
"""

from typing import Optional

from transformers import PretrainedConfig


class TsLMConfig(PretrainedConfig):
    """Every option of the fairseq model that changes its function.

    ``backbone``: ``magneto`` (Pre-LN plus Sub-LN before ``out_proj`` and ``fc2``), ``preln``,
    ``postln`` or ``deepnorm`` (Post-LN with the residual scaled by ``residual_alpha``).
    ``positions``: ``learned``, ``sinusoidal`` or ``none``; absolute positions start at
    ``pad_token_id + 1`` and skip padding (fairseq's ``make_positions``). ``embed_scale``
    multiplies the token embedding (``sqrt(hidden_size)`` unless the model was trained with
    ``--no-scale-embedding``). ``moe_*``: X-MoE / linear-router experts in every
    ``moe_freq``-th layer, evaluated as fairseq evaluates them (no second-expert sampling,
    capacity ``moe_eval_capacity_factor``, ``<= 0`` = no dropping).

    Adaptive input / softmax (fairseq's ``AdaptiveInput`` / ``AdaptiveSoftmax``): the cutoffs are
    band edges ending at ``vocab_size`` (band i = ids ``[c_{i-1}, c_i)``, ``c_{-1} = 0``).
    ``adaptive_input_cutoff`` (``None``: one embedding table): band i is embedded at dimension
    ``int(hidden_size // adaptive_input_factor**i)`` and projected to ``hidden_size``.
    ``adaptive_softmax_cutoff`` (``None``: a linear ``lm_head`` whose outputs are logits): the
    head scores the ``c_0`` frequent ids and one cluster per tail band, tail band i projects to
    dimension ``int(hidden_size // adaptive_softmax_factor**(i + 1))`` (dropout
    ``adaptive_softmax_dropout`` after the projection); the model's ``logits`` are then
    log-probabilities over the whole vocabulary (their log-softmax is themselves), equal to
    fairseq's ``get_normalized_probs(log_probs=True)``. ``tie_adaptive_weights``: the head's word
    rows and the tail bands' outputs are the adaptive input's band embeddings;
    ``tie_adaptive_proj``: the tail projections are its band projections, transposed.

    ``causal`` (a class attribute, not saved): queries attend to earlier tokens only;
    ``cross_attention`` (also): every layer attends to an encoder's output after its self-attention.
    """

    model_type = "ts_lm"
    causal = True
    cross_attention = False
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 50261,
        hidden_size: int = 768,
        intermediate_size: int = 3072,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        backbone: str = "magneto",
        residual_alpha: float = 1.0,
        activation: str = "gelu",
        positions: str = "sinusoidal",
        max_position_embeddings: int = 1024,
        embed_scale: float = 1.0,
        layernorm_embedding: bool = False,
        layer_norm_eps: float = 1e-5,
        rel_pos_buckets: int = 0,
        max_rel_pos: int = 128,
        xpos: bool = False,
        xpos_scale_base: float = 512.0,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        activation_dropout: float = 0.0,
        moe_expert_count: int = 0,
        moe_freq: int = 2,
        moe_top_k: int = 2,
        moe_router: str = "xmoe",
        moe_router_dim: int = 16,
        moe_expert_ffn_dim: int = 0,
        moe_shared_expert_count: int = 0,
        moe_router_bias: bool = False,
        moe_eval_capacity_factor: float = 0.0,
        moe_normalize_gate_prob_before_dropping: bool = False,
        adaptive_input_cutoff: Optional[list[int]] = None,
        adaptive_input_factor: float = 4.0,
        adaptive_softmax_cutoff: Optional[list[int]] = None,
        adaptive_softmax_factor: float = 4.0,
        adaptive_softmax_dropout: float = 0.0,
        tie_adaptive_weights: bool = False,
        tie_adaptive_proj: bool = False,
        tie_word_embeddings: bool = True,
        bos_token_id: int = 2,
        pad_token_id: int = 1,
        eos_token_id: int = 2,
        use_cache: bool = True,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.backbone = backbone
        self.residual_alpha = residual_alpha
        self.activation = activation
        self.positions = positions
        self.max_position_embeddings = max_position_embeddings
        self.embed_scale = embed_scale
        self.layernorm_embedding = layernorm_embedding
        self.layer_norm_eps = layer_norm_eps
        self.rel_pos_buckets = rel_pos_buckets
        self.max_rel_pos = max_rel_pos
        self.xpos = xpos
        self.xpos_scale_base = xpos_scale_base
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation_dropout = activation_dropout
        self.moe_expert_count = moe_expert_count
        self.moe_freq = moe_freq
        self.moe_top_k = moe_top_k
        self.moe_router = moe_router
        self.moe_router_dim = moe_router_dim
        self.moe_expert_ffn_dim = moe_expert_ffn_dim or intermediate_size  # each expert's width
        self.moe_shared_expert_count = moe_shared_expert_count  # one FFN this many experts wide
        self.moe_router_bias = moe_router_bias  # an expert_bias added to the probabilities for the choice
        self.moe_eval_capacity_factor = moe_eval_capacity_factor
        self.moe_normalize_gate_prob_before_dropping = moe_normalize_gate_prob_before_dropping
        self.adaptive_input_cutoff = adaptive_input_cutoff
        self.adaptive_input_factor = adaptive_input_factor
        self.adaptive_softmax_cutoff = adaptive_softmax_cutoff
        self.adaptive_softmax_factor = adaptive_softmax_factor
        self.adaptive_softmax_dropout = adaptive_softmax_dropout
        self.tie_adaptive_weights = tie_adaptive_weights
        self.tie_adaptive_proj = tie_adaptive_proj
        self.use_cache = use_cache
        super().__init__(
            bos_token_id=bos_token_id, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings, **kwargs,
        )

    @property
    def normalize_before(self) -> bool:
        return self.backbone in ("magneto", "preln")

    @property
    def subln(self) -> bool:
        return self.backbone == "magneto"

    def is_moe_layer(self, index: int) -> bool:
        return self.moe_expert_count > 0 and (index + 1) % self.moe_freq == 0
