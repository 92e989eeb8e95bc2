"""Turn a checkpoint of TorchScale's ``Decoder`` (microsoft/torchscale 0.3.0) into a ``ts_lm`` checkpoint.

Input: a ``torch.save`` file with the decoder's weights under ``model`` (a bare ``Decoder``'s
``state_dict()``, or TorchScale's fairseq-example LM, whose keys start with ``decoder.``) and
its ``DecoderConfig`` fields under ``cfg.model`` (the fairseq example) or ``args`` (a dict or
namespace, e.g. ``vars(DecoderConfig(...))``).

Mapping (TorchScale -> ts_lm): ``subln`` -> ``--backbone magneto``; ``deepnorm`` -> ``deepnorm``
(same alpha ``(2M)^1/4``); otherwise ``decoder_normalize_before`` -> ``preln`` / ``postln``;
``q_proj``/``k_proj``/``v_proj`` -> one ``qkv_proj`` (rows ``[q; k; v]``); ``no_scale_embedding``
(TorchScale's default is *no* scale, ours is ``sqrt(d)``) -> ``--no-scale-embedding``;
``xpos_rel_pos`` -> ``--xpos``; a learned position table (fairseq layout, rows from ``pad + 1``)
-> ``--decoder-learned-pos``; no table -> ``positions`` (``none``, TorchScale's ``Decoder``
default, or ``sinusoidal`` for fairseq's sinusoidal table, which has no weights);
``output_projection`` tied to ``embed_tokens`` -> ``--share-decoder-input-output-embed``.
MoE layers (``moe_expert_count``, ``moe_freq``): the linear gate ``wg`` -> ``--moe-router linear``;
the experts' ``fc1``/``fc2``/``ffn_layernorm`` stacked as ``ffn.experts.*`` (``(E, in, out)``);
``moe_top1_expert`` -> ``--moe-top-k 1``; second-expert policy, gate normalisation before dropping
and the evaluation capacity ``ceil(fraction * T)`` mapped (see :func:`moe_flags`). Only the
single-process layout (every expert in one ``state_dict``) is read.
Refused with one line: ``use_xmoe`` (TorchScale's X-MoE gate scores differ from ts_lm's cosine
router), ``moe_gating_use_fp32=False``, one rank's expert shard, relative position buckets
(TorchScale's decoder bias is bidirectional, ours causal), multiway, ``swish`` activation, an xPos scale base other than 512.
The full list of default differences is in ``docs/interop.md``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from fairseq import checkpoint_utils, options
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import OmegaConf

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.interop.checkpoint_files import read_checkpoint

PLUGIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POSITIONS = ("none", "sinusoidal")


def torchscale_config(state: dict[str, Any]) -> dict[str, Any]:
    """The ``DecoderConfig`` fields recorded in ``state``."""
    cfg = state.get("cfg") or {}
    found = cfg.get("model") if hasattr(cfg, "get") else None
    found = found if found is not None else state.get("args")
    if found is None:
        raise TsConfigError("the checkpoint records no TorchScale DecoderConfig (cfg.model or args): "
                            "save it with args=vars(decoder.args)")
    return dict(vars(found) if isinstance(found, argparse.Namespace) else found)


def decoder_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The decoder's weights with the fairseq example's ``decoder.`` prefix removed."""
    model = state.get("model")
    if not isinstance(model, dict) or "embed_tokens.weight" not in {k.removeprefix("decoder.") for k in model}:
        raise TsConfigError("the checkpoint has no TorchScale Decoder weights (model.embed_tokens.weight): "
                            "save {'model': decoder.state_dict(), 'args': vars(decoder.args)}")
    return {k.removeprefix("decoder."): v for k, v in model.items() if isinstance(v, torch.Tensor)}


def _refuse_unsupported(ts: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    moe, count = is_moe(ts), int(ts.get("moe_expert_count") or 0)
    shards = {layer: n for layer, n in held_experts(weights).items() if n != count}
    checks = [
        (moe and bool(ts.get("use_xmoe")),
         "use_xmoe: TorchScale 0.3.0's X-MoE gate scores (W x).e/|e| (no token normalisation, no temperature), "
         "ts_lm's xmoe router cos(W x, e)/tau; only its linear gate (use_xmoe False) is imported"),
        (moe and not ts.get("moe_gating_use_fp32", True), "moe_gating_use_fp32 False (ts_lm's router runs in fp32)"),
        (moe and bool(shards), f"MoE layers {sorted(shards)} hold {sorted(set(shards.values()))} of {count} experts: "
         "one rank's expert shard; only the single-process layout (every expert in one state_dict) is imported"),
        ((ts.get("rel_pos_buckets") or 0) > 0 and (ts.get("max_rel_pos") or 0) > 0,
         "--rel-pos-buckets: TorchScale's decoder bias is bidirectional, ts_lm's is causal"),
        (bool(ts.get("multiway")), "multiway (BEiT-3) layers"),
        (ts.get("activation_fn", "gelu") not in ("gelu", "relu"),
         f"activation {ts.get('activation_fn')!r} (ts_lm has gelu, relu and swiglu)"),
        (bool(ts.get("xpos_rel_pos")) and float(ts.get("xpos_scale_base", 512)) != 512.0,
         f"xpos_scale_base {ts.get('xpos_scale_base')} (ts_lm's xPos uses 512)"),
        (any(".encoder_attn." in k for k in weights), "cross-attention (an encoder-decoder's decoder)"),
    ]
    for bad, why in checks:
        if bad:
            raise TsConfigError(f"cannot import this TorchScale checkpoint: {why}")


def is_moe(ts: dict[str, Any]) -> bool:
    """TorchScale builds MoE layers when both ``moe_expert_count`` and ``moe_freq`` are positive."""
    return (ts.get("moe_expert_count") or 0) > 0 and (ts.get("moe_freq") or 0) > 0


def held_experts(weights: dict[str, torch.Tensor]) -> dict[int, int]:
    """Experts per MoE layer in ``weights`` (``layers.I.moe_layer.experts.E.*``)."""
    held: dict[int, set[str]] = {}
    for name in weights:
        parts = name.split(".")
        if parts[2:4] == ["moe_layer", "experts"]:
            held.setdefault(int(parts[1]), set()).add(parts[4])
    return {layer: len(ids) for layer, ids in held.items()}


def backbone_of(ts: dict[str, Any]) -> str:
    """TorchScale's ``DecoderConfig`` resolves ``deepnorm`` before ``subln`` (one turns the other off)."""
    if ts.get("deepnorm"):
        return "deepnorm"
    if ts.get("subln", True):
        return "magneto"
    return "preln" if ts.get("decoder_normalize_before", True) else "postln"


def ts_lm_weights(weights: dict[str, torch.Tensor], layers: int, tied: bool) -> dict[str, torch.Tensor]:
    """TorchScale names -> ``ts_lm`` names (fused ``[q; k; v]``); constant buffers (xPos scales,
    fairseq's sinusoidal ``_float_tensor``) are dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith(("_float_tensor", ".xpos.scale")) or any(
                f".{part}." in name for part in ("q_proj", "k_proj", "v_proj", "moe_layer")):
            continue
        if name == "output_projection.weight":
            if not tied:
                out["decoder.output_projection.weight"] = tensor
        elif name.startswith(("embed_tokens.", "embed_positions.", "layernorm_embedding.")):
            out["decoder.embed." + name] = tensor
        else:
            out["decoder." + name] = tensor
    for i in range(layers):
        for kind in ("weight", "bias"):
            parts = [weights[f"layers.{i}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[f"decoder.layers.{i}.self_attn.qkv_proj.{kind}"] = torch.cat(parts, 0)
    return out | moe_weights(weights, layers)


EXPERT_NAMES = (("fc1_weight", "fc1.weight"), ("fc1_bias", "fc1.bias"), ("fc2_weight", "fc2.weight"),
                ("fc2_bias", "fc2.bias"), ("ln_weight", "ffn_layernorm.weight"), ("ln_bias", "ffn_layernorm.bias"))


def moe_weights(weights: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """TorchScale's MoE layers -> ``ts_lm``'s: ``gate.wg`` -> the linear router, the experts'
    ``nn.Linear`` weights ``(out, in)`` stacked as ``(expert, in, out)``, biases and sub-LN stacked."""
    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        src, dst = f"layers.{i}.moe_layer.", f"decoder.layers.{i}.ffn."
        if src + "gate.wg.weight" not in weights:
            continue
        out[dst + "router.gate.weight"] = weights[src + "gate.wg.weight"]
        count = held_experts(weights)[i]
        for ours, theirs in EXPERT_NAMES:
            if f"{src}experts.0.{theirs}" in weights:
                parts = [weights[f"{src}experts.{e}.{theirs}"] for e in range(count)]
                out[dst + "experts." + ours] = torch.stack([p.t() if p.dim() == 2 else p for p in parts])
    return out


def moe_flags(ts: dict[str, Any]) -> list[str]:
    """``ts_lm``'s MoE flags: a linear router, TorchScale's top-1 / top-2 and second-expert policy
    (any policy but ``random`` and ``sampling`` keeps the second expert: ``all``), training capacity
    factor 1, evaluation capacity ``ceil(fraction * T)`` as the factor ``fraction * E / k`` (a
    fraction of 0: the training capacity)."""
    count, top_k = int(ts["moe_expert_count"]), 1 if ts.get("moe_top1_expert") else 2
    fraction = float(ts.get("moe_eval_capacity_token_fraction", 0.25))
    policy = ts.get("moe_second_expert_policy", "random")
    flags = ["--moe-expert-count", str(count), "--moe-freq", str(ts["moe_freq"]), "--moe-top-k", str(top_k),
             "--moe-router", "linear", "--moe-capacity-factor", "1.0",
             "--moe-eval-capacity-factor", str(fraction * count / top_k if fraction > 0 else 1.0),
             "--moe-second-expert-policy", policy if policy in ("random", "sampling") else "all"]
    if ts.get("moe_normalize_gate_prob_before_dropping"):
        flags.append("--moe-normalize-gate-prob-before-dropping")
    return flags


def ts_lm_flags(ts: dict[str, Any], weights: dict[str, torch.Tensor], positions: str, tied: bool) -> list[str]:
    """The ``fairseq-train`` model flags (after ``--arch ts_lm``) of the equivalent ``ts_lm``."""
    dim = weights["embed_tokens.weight"].size(1)
    max_positions = int(ts.get("max_target_positions") or 1024)
    flags = [
        "--backbone", backbone_of(ts), "--decoder-layers", str(ts.get("decoder_layers", 12)),
        "--decoder-embed-dim", str(dim), "--decoder-ffn-embed-dim",
        str(next(t for k, t in weights.items() if k.endswith(".fc1.weight")).size(0)),
        "--decoder-attention-heads", str(ts.get("decoder_attention_heads", 12)),
        "--activation-fn", str(ts.get("activation_fn", "gelu")),
        "--dropout", str(ts.get("dropout", 0.0)), "--attention-dropout", str(ts.get("attention_dropout", 0.0)),
        "--activation-dropout", str(ts.get("activation_dropout", 0.0)),
        "--layernorm-eps", str(ts.get("layernorm_eps", 1e-5)), "--max-target-positions", str(max_positions),
    ]
    if ts.get("no_scale_embedding", True):
        flags.append("--no-scale-embedding")
    if ts.get("layernorm_embedding"):
        flags.append("--layernorm-embedding")
    if ts.get("xpos_rel_pos"):
        flags.append("--xpos")
    if tied:
        flags.append("--share-decoder-input-output-embed")
    if is_moe(ts):
        flags += moe_flags(ts)
    if "embed_positions.weight" in weights:
        flags.append("--decoder-learned-pos")
    elif positions == "none":
        flags.append("--no-token-positional-embeddings")
    return flags


def import_torchscale(source: str, output: str, data: str, positions: str = "none") -> list[str]:
    """Write the ``ts_lm`` checkpoint ``output`` of the TorchScale checkpoint ``source``; returns the
    ``fairseq-train`` model flags that continue training it (``--arch ts_lm FLAGS --restore-file OUTPUT``).
    ``data``: the fairseq data directory (its ``dict.txt`` must have one entry per embedding row);
    ``positions``: ``none`` or ``sinusoidal`` when the checkpoint has no learned position table."""
    if positions not in POSITIONS:
        raise TsConfigError(f"--positions {positions!r} is unknown: choose one of {', '.join(POSITIONS)}")
    if os.path.exists(output):
        raise TsConfigError(f"{output} already exists: choose a new checkpoint name (nothing was written)")
    if not os.path.isfile(source):
        raise TsConfigError(f"no checkpoint {source}: check the path")
    state = read_checkpoint(source)
    ts, weights = torchscale_config(state), decoder_weights(state)
    _refuse_unsupported(ts, weights)
    dict_path = os.path.join(data, "dict.txt")
    if not os.path.isfile(dict_path):
        raise TsConfigError(f"{dict_path} does not exist: --data is the fairseq data directory the model will read")
    vocab = weights["embed_tokens.weight"].size(0)
    if len(Dictionary.load(dict_path)) != vocab:
        raise TsConfigError(f"{dict_path} has {len(Dictionary.load(dict_path))} entries but the embedding "
                            f"{vocab} rows: use the dictionary the TorchScale model was trained with")
    out_proj = weights.get("output_projection.weight")
    tied = out_proj is None or out_proj.data_ptr() == weights["embed_tokens.weight"].data_ptr() or bool(
        ts.get("share_decoder_input_output_embed"))
    flags = ts_lm_flags(ts, weights, positions, tied)
    max_positions = flags[flags.index("--max-target-positions") + 1]
    argv = [data, "--user-dir", PLUGIN_DIR, "--task", "language_modeling", "--arch", "ts_lm", *flags,
            "--tokens-per-sample", max_positions]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    new_state = {
        "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "args": None,
        "model": ts_lm_weights(weights, args.decoder_layers, tied),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "none",
                               "lr_scheduler_state": {}, "num_updates": 0}],
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0}},
        "last_optimizer_state": None,
    }
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    checkpoint_utils.torch_persistent_save(new_state, output)
    return flags
