"""MoE settings of one stack, read from fairseq args, with the one-line flag checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchscale_fairseq.choices import choice
from torchscale_fairseq.errors import TsConfigError

ROUTERS = ("xmoe", "linear", "expert_choice", "torchscale_xmoe")
SECOND_EXPERT_POLICIES = ("random", "sampling", "all", "coin")
BALANCE_SCOPES = ("local", "global")
CHECKPOINT_EXCHANGES = ("repeat", "keep")  # --moe-checkpoint-exchange, see modules/moe/layer.py
EXPERT_TENSOR_PARALLEL = ("split", "replicate")
COMPILED_ROUTING = ("off", "on")  # --moe-compiled-routing, see MoELayer._routes_compiled
COMPILED_EXPERTS = ("off", "on")  # --moe-compiled-experts, see MoELayer._combines_compiled
MAX_TOP_K = 8


@dataclass(frozen=True)
class MoEConfig:
    expert_count: int
    freq: int = 2
    top_k: int = 2
    expert_ffn_dim: int = 0  # 0: the dense FFN's width
    shared_expert_count: int = 0
    router_bias_update_rate: float = 0.0
    expert_parallel_size: int = 0  # 0: the default layout of model_parallel.expert_parallel
    router: str = "xmoe"
    router_dim: int = 16
    gate_noise: float = 0.0
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 0.0
    second_expert_policy: str = "random"
    normalize_gate_prob_before_dropping: bool = False
    balance_scope: str = "local"
    checkpoint_exchange: str = "repeat"
    expert_tensor_parallel: str = "split"
    compiled_routing: str = "off"
    compiled_experts: str = "off"

    def is_moe_layer(self, index: int) -> bool:
        """Every ``freq``-th FFN (1-based: layers freq, 2 freq, ...) is an MoE layer."""
        return self.expert_count > 0 and (index + 1) % self.freq == 0


def moe_config_from_args(args: Any) -> MoEConfig | None:
    """``None`` for a dense model; raises :class:`TsConfigError` on bad flags."""
    count = getattr(args, "moe_expert_count", 0) or 0
    if count < 0:
        raise TsConfigError(f"--moe-expert-count {count} is negative: use 0 (dense) or a positive expert count")
    if count == 0:
        return None
    cfg = MoEConfig(
        expert_count=count,
        freq=getattr(args, "moe_freq", 2),
        top_k=getattr(args, "moe_top_k", 2),
        expert_ffn_dim=getattr(args, "moe_expert_ffn_dim", 0) or 0,
        shared_expert_count=getattr(args, "moe_shared_expert_count", 0) or 0,
        router_bias_update_rate=getattr(args, "moe_router_bias_update_rate", 0.0) or 0.0,
        expert_parallel_size=getattr(args, "moe_expert_parallel_size", 0) or 0,
        router=choice(args, "moe_router", "xmoe"),
        router_dim=getattr(args, "moe_router_dim", 16),
        gate_noise=getattr(args, "moe_gate_noise", 0.0),
        capacity_factor=getattr(args, "moe_capacity_factor", 1.25),
        eval_capacity_factor=getattr(args, "moe_eval_capacity_factor", 0.0),
        second_expert_policy=choice(args, "moe_second_expert_policy", "random"),
        normalize_gate_prob_before_dropping=getattr(args, "moe_normalize_gate_prob_before_dropping", False),
        balance_scope=choice(args, "moe_balance_scope", "local"),
        checkpoint_exchange=choice(args, "moe_checkpoint_exchange", "repeat"),
        expert_tensor_parallel=choice(args, "moe_expert_tensor_parallel", "split"),
        compiled_routing=choice(args, "moe_compiled_routing", "off"),
        compiled_experts=choice(args, "moe_compiled_experts", "off"),
    )
    check_moe_config(cfg)
    return cfg


def check_moe_config(cfg: MoEConfig) -> None:
    if cfg.freq <= 0:
        raise TsConfigError(f"--moe-freq {cfg.freq} must be positive: use 1 (every FFN) or 2 (every second FFN)")
    if not 1 <= cfg.top_k <= MAX_TOP_K:
        raise TsConfigError(f"--moe-top-k {cfg.top_k} is not supported: use 1 to {MAX_TOP_K}")
    if cfg.top_k > cfg.expert_count:
        raise TsConfigError(
            f"--moe-top-k {cfg.top_k} is larger than --moe-expert-count {cfg.expert_count}: lower top-k or add experts"
        )
    for flag, value, choices in (
        ("--moe-router", cfg.router, ROUTERS),
        ("--moe-second-expert-policy", cfg.second_expert_policy, SECOND_EXPERT_POLICIES),
        ("--moe-balance-scope", cfg.balance_scope, BALANCE_SCOPES),
        ("--moe-checkpoint-exchange", cfg.checkpoint_exchange, CHECKPOINT_EXCHANGES),
        ("--moe-expert-tensor-parallel", cfg.expert_tensor_parallel, EXPERT_TENSOR_PARALLEL),
        ("--moe-compiled-routing", cfg.compiled_routing, COMPILED_ROUTING),
        ("--moe-compiled-experts", cfg.compiled_experts, COMPILED_EXPERTS),
    ):
        if value not in choices:
            raise TsConfigError(f"{flag} {value!r} is unknown: choose one of {', '.join(choices)}")
    if cfg.router_dim <= 0:
        raise TsConfigError(f"--moe-router-dim {cfg.router_dim} must be positive (X-MoE uses 16)")
    if cfg.gate_noise < 0:
        raise TsConfigError(f"--moe-gate-noise {cfg.gate_noise} must be >= 0")
    for flag, value in (("--moe-capacity-factor", cfg.capacity_factor),
                        ("--moe-eval-capacity-factor", cfg.eval_capacity_factor)):
        if value < 0:
            raise TsConfigError(f"{flag} {value} is negative: use 0 (no dropping) or a factor > 0 (GShard: 1.25)")
    if cfg.top_k > 2 and cfg.second_expert_policy in ("sampling", "coin"):
        raise TsConfigError(f"--moe-second-expert-policy {cfg.second_expert_policy} applies to top-2 only: with "
                            f"--moe-top-k {cfg.top_k} every chosen expert is kept (use random or all)")
    if cfg.expert_ffn_dim < 0:
        raise TsConfigError(f"--moe-expert-ffn-dim {cfg.expert_ffn_dim} is negative: use 0 (the dense FFN's "
                            "width) or a positive width")
    if cfg.shared_expert_count < 0:
        raise TsConfigError(f"--moe-shared-expert-count {cfg.shared_expert_count} is negative: use 0 (none) or "
                            "a positive count")
    if cfg.router_bias_update_rate < 0:
        raise TsConfigError(f"--moe-router-bias-update-rate {cfg.router_bias_update_rate} is negative: use 0 (off) "
                            "or a small positive rate (DeepSeek-V3: 1e-3)")
    if cfg.router_bias_update_rate > 0 and cfg.router == "expert_choice":
        raise TsConfigError("--moe-router-bias-update-rate biases each token's choice of experts, and "
                            "--moe-router expert_choice has experts choose tokens: use a token-choice router "
                            "(xmoe, linear, torchscale_xmoe) or rate 0")
    if cfg.router_bias_update_rate > 0 and cfg.top_k == 2 and cfg.second_expert_policy == "sampling":
        raise TsConfigError("--moe-router-bias-update-rate with --moe-second-expert-policy sampling: the Gumbel "
                            "draw of the second expert ignores the bias; use random or all")
    if cfg.router == "expert_choice" and cfg.capacity_factor <= 0:
        raise TsConfigError("--moe-router expert_choice needs --moe-capacity-factor > 0 (tokens each expert takes)")
