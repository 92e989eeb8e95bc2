"""Turn a checkpoint of TorchScale's ``Decoder`` (microsoft/torchscale 0.3.0) into a ``ts_lm``
checkpoint, or of its ``EncoderDecoder`` into a ``ts_transformer`` checkpoint.

Input: a ``torch.save`` file with the weights under ``model`` (a bare ``Decoder``'s
``state_dict()``, TorchScale's fairseq-example LM, whose keys start with ``decoder.``, or an
``EncoderDecoder``'s, with ``encoder.`` and ``decoder.`` keys) and its config fields under
``cfg.model`` (the fairseq example) or ``args`` (a dict or namespace, e.g. ``vars(DecoderConfig(...))``).

Mapping (TorchScale -> ts_lm): ``subln`` -> ``--backbone magneto``; ``deepnorm`` -> ``deepnorm``
(same alpha ``(2M)^1/4``); otherwise ``decoder_normalize_before`` -> ``preln`` / ``postln``;
``q_proj``/``k_proj``/``v_proj`` -> one ``qkv_proj`` (rows ``[q; k; v]``); ``no_scale_embedding``
(TorchScale's default is *no* scale, ours is ``sqrt(d)``) -> ``--no-scale-embedding``;
``xpos_rel_pos`` -> ``--xpos``; a learned position table (fairseq layout, rows from ``pad + 1``)
-> ``--decoder-learned-pos``; no table -> ``positions`` (``none``, TorchScale's ``Decoder``
default, or ``sinusoidal`` for fairseq's sinusoidal table, which has no weights);
``output_projection`` tied to ``embed_tokens`` -> ``--share-decoder-input-output-embed``.
An ``EncoderDecoder``: the same on both sides, ``encoder_attn`` -> ``cross_attn`` (``q_proj``;
``kv_proj`` = rows ``[k; v]``), one shared embedding -> ``--share-all-embeddings``; refused: ``subln``
(TorchScale's cross-attention has no Sub-LN), different ``*_normalize_before``, xPos.
MoE layers (``moe_expert_count``, ``moe_freq``): the linear gate ``wg`` -> ``--moe-router linear``;
``use_xmoe``'s gate (``wg_reduction``, ``wg``) -> ``--moe-router torchscale_xmoe`` (``router.proj``,
``router.expert_embeddings``; its scores ``(W x) . e / |e|`` have no temperature);
the experts' ``fc1``/``fc2``/``ffn_layernorm`` stacked as ``ffn.experts.*`` (``(E, in, out)``);
``moe_top1_expert`` -> ``--moe-top-k 1``; second-expert policy, gate normalisation before dropping
and the evaluation capacity ``ceil(fraction * T)`` mapped (see :func:`moe_flags`). Only the
single-process layout (every expert in one ``state_dict``) is read.
Refused with one line: ``moe_gating_use_fp32=False``, one rank's expert shard, relative position buckets
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
    """The ``DecoderConfig`` (or ``EncoderDecoderConfig``) fields recorded in ``state``."""
    cfg = state.get("cfg") or {}
    found = cfg.get("model") if hasattr(cfg, "get") else None
    found = found if found is not None else state.get("args")
    if found is None:
        raise TsConfigError("the checkpoint records no TorchScale DecoderConfig (cfg.model or args): "
                            "save it with args=vars(model.args)")
    return dict(vars(found) if isinstance(found, argparse.Namespace) else found)


def torchscale_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of ``state["model"]``, every name under ``encoder.`` or ``decoder.`` (a bare
    ``Decoder``'s names get ``decoder.``; the fairseq example's and ``EncoderDecoder``'s have it)."""
    model = state.get("model")
    if not isinstance(model, dict) or "embed_tokens.weight" not in {k.removeprefix("decoder.") for k in model}:
        raise TsConfigError("the checkpoint has no TorchScale Decoder weights (model.embed_tokens.weight): "
                            "save {'model': decoder.state_dict(), 'args': vars(decoder.args)}")
    prefixed = "decoder.embed_tokens.weight" in model
    return {k if prefixed else "decoder." + k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def is_encoder_decoder(weights: dict[str, torch.Tensor]) -> bool:
    """Whether ``weights`` (named as :func:`torchscale_weights` names them) are an ``EncoderDecoder``'s."""
    return "encoder.embed_tokens.weight" in weights


def _refuse_unsupported(ts: dict[str, Any], weights: dict[str, torch.Tensor], positions: str) -> None:
    moe, count = is_moe(ts), int(ts.get("moe_expert_count") or 0)
    shards = {layer: n for layer, n in held_experts(weights).items() if n != count}
    encdec = is_encoder_decoder(weights)
    tables = {side: f"{side}.embed_positions.weight" in weights for side in ("encoder", "decoder")}
    checks = [
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
        (not encdec and any(".encoder_attn." in k for k in weights),
         "cross-attention without the encoder (save the whole EncoderDecoder's state_dict)"),
        (encdec and bool(ts.get("xpos_rel_pos")), "xPos in an encoder-decoder"),
        (encdec and backbone_of(ts) == "magneto", "subln in an encoder-decoder: TorchScale's cross-attention has "
         "no Sub-LN (inner_attn_ln), ts_transformer's magneto has one"),
        (encdec and ts.get("encoder_normalize_before", True) != ts.get("decoder_normalize_before", True),
         "encoder_normalize_before differs from decoder_normalize_before (ts_transformer has one backbone)"),
        (encdec and positions == "none" and tables["encoder"] != tables["decoder"],
         "a learned position table on one side only (ts_transformer would give the other side sinusoids)"),
    ]
    for bad, why in checks:
        if bad:
            raise TsConfigError(f"cannot import this TorchScale checkpoint: {why}")


def is_moe(ts: dict[str, Any]) -> bool:
    """TorchScale builds MoE layers when both ``moe_expert_count`` and ``moe_freq`` are positive."""
    return (ts.get("moe_expert_count") or 0) > 0 and (ts.get("moe_freq") or 0) > 0


def held_experts(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """Experts per MoE layer (``SIDE.layers.I``) in ``weights`` (``SIDE.layers.I.moe_layer.experts.E.*``)."""
    held: dict[str, set[str]] = {}
    for name in weights:
        parts = name.split(".")
        if parts[3:5] == ["moe_layer", "experts"]:
            held.setdefault(".".join(parts[:3]), set()).add(parts[5])
    return {layer: len(ids) for layer, ids in held.items()}


def backbone_of(ts: dict[str, Any]) -> str:
    """TorchScale's ``DecoderConfig`` resolves ``deepnorm`` before ``subln`` (one turns the other off)."""
    if ts.get("deepnorm"):
        return "deepnorm"
    if ts.get("subln", True):
        return "magneto"
    return "preln" if ts.get("decoder_normalize_before", True) else "postln"


def _ours(name: str) -> str:
    return name.replace(".encoder_attn_layer_norm.", ".cross_attn_layer_norm.").replace(".encoder_attn.", ".cross_attn.")


def ts_weights(weights: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """TorchScale names -> ``ts_lm`` / ``ts_transformer`` names: self-attention ``[q; k; v]`` fused
    into ``qkv_proj``, cross-attention (``encoder_attn``) ``[k; v]`` into ``cross_attn.kv_proj``;
    constant buffers (xPos scales, fairseq's sinusoidal ``_float_tensor``) are dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        side, _, rest = name.partition(".")
        if ".q_proj." in name:
            k, v = (weights[name.replace(".q_proj.", f".{p}_proj.")] for p in "kv")
            if ".encoder_attn." in name:
                out[_ours(name)] = tensor
                out[_ours(name).replace(".q_proj.", ".kv_proj.")] = torch.cat([k, v], 0)
            else:
                out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat([tensor, k, v], 0)
        elif name.endswith(("_float_tensor", ".xpos.scale")) or any(
                f".{part}." in name for part in ("k_proj", "v_proj", "moe_layer")):
            continue
        elif rest == "output_projection.weight":
            if not tied:
                out[name] = tensor
        elif rest.startswith(("embed_tokens.", "embed_positions.", "layernorm_embedding.")):
            out[f"{side}.embed.{rest}"] = tensor
        else:
            out[_ours(name)] = tensor
    return out | moe_weights(weights)


EXPERT_NAMES = (("fc1_weight", "fc1.weight"), ("fc1_bias", "fc1.bias"), ("fc2_weight", "fc2.weight"),
                ("fc2_bias", "fc2.bias"), ("ln_weight", "ffn_layernorm.weight"), ("ln_bias", "ffn_layernorm.bias"))


def moe_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TorchScale's MoE layers -> ours: ``gate.wg`` -> the linear router (``use_xmoe``:
    ``gate.wg_reduction`` and ``gate.wg`` -> the ``torchscale_xmoe`` router), the experts'
    ``nn.Linear`` weights ``(out, in)`` stacked as ``(expert, in, out)``, biases and sub-LN stacked."""
    out: dict[str, torch.Tensor] = {}
    for layer, count in held_experts(weights).items():
        src, dst = f"{layer}.moe_layer.", f"{layer}.ffn."
        if src + "gate.wg_reduction.weight" in weights:
            out[dst + "router.proj.weight"] = weights[src + "gate.wg_reduction.weight"]
            out[dst + "router.expert_embeddings"] = weights[src + "gate.wg"]
        else:
            out[dst + "router.gate.weight"] = weights[src + "gate.wg.weight"]
        for ours, theirs in EXPERT_NAMES:
            if f"{src}experts.0.{theirs}" in weights:
                parts = [weights[f"{src}experts.{e}.{theirs}"] for e in range(count)]
                out[dst + "experts." + ours] = torch.stack([p.t() if p.dim() == 2 else p for p in parts])
    return out
def moe_flags(ts: dict[str, Any]) -> list[str]:
    """``ts_lm``'s MoE flags: a linear router (``use_xmoe``: ``torchscale_xmoe`` with its 16
    dimensions), TorchScale's top-1 / top-2 and second-expert policy
    (any policy but ``random`` and ``sampling`` keeps the second expert: ``all``), training capacity
    factor 1, evaluation capacity ``ceil(fraction * T)`` as the factor ``fraction * E / k`` (a
    fraction of 0: the training capacity)."""
    count, top_k = int(ts["moe_expert_count"]), 1 if ts.get("moe_top1_expert") else 2
    fraction = float(ts.get("moe_eval_capacity_token_fraction", 0.25))
    policy = ts.get("moe_second_expert_policy", "random")
    flags = ["--moe-expert-count", str(count), "--moe-freq", str(ts["moe_freq"]), "--moe-top-k", str(top_k),
             "--moe-router", "torchscale_xmoe" if ts.get("use_xmoe") else "linear", "--moe-router-dim", "16",
             "--moe-capacity-factor", "1.0",
             "--moe-eval-capacity-factor", str(fraction * count / top_k if fraction > 0 else 1.0),
             "--moe-second-expert-policy", policy if policy in ("random", "sampling") else "all"]
    if ts.get("moe_normalize_gate_prob_before_dropping"):
        flags.append("--moe-normalize-gate-prob-before-dropping")
    return flags


def _side_flags(side: str, ts: dict[str, Any], weights: dict[str, torch.Tensor]) -> list[str]:
    fc1 = next(t for k, t in weights.items() if k.startswith(side + ".") and k.endswith(".fc1.weight"))
    flags = [f"--{side}-layers", str(ts.get(f"{side}_layers", 12)),
             f"--{side}-embed-dim", str(weights[f"{side}.embed_tokens.weight"].size(1)),
             f"--{side}-ffn-embed-dim", str(fc1.size(0)),
             f"--{side}-attention-heads", str(ts.get(f"{side}_attention_heads", 12))]
    return flags + ([f"--{side}-learned-pos"] if f"{side}.embed_positions.weight" in weights else [])


def model_flags(ts: dict[str, Any], weights: dict[str, torch.Tensor], positions: str, tied: bool) -> list[str]:
    """The ``fairseq-train`` model flags (after ``--arch ts_lm``, or ``ts_transformer`` for an
    ``EncoderDecoder``) of the equivalent model."""
    encdec = is_encoder_decoder(weights)
    flags = [
        "--backbone", backbone_of(ts), *(_side_flags("encoder", ts, weights) if encdec else []),
        *_side_flags("decoder", ts, weights), "--activation-fn", str(ts.get("activation_fn", "gelu")),
        "--dropout", str(ts.get("dropout", 0.0)), "--attention-dropout", str(ts.get("attention_dropout", 0.0)),
        "--activation-dropout", str(ts.get("activation_dropout", 0.0)),
        "--layernorm-eps", str(ts.get("layernorm_eps", 1e-5)),
        "--max-target-positions", str(int(ts.get("max_target_positions") or 1024)),
    ]
    if encdec:
        flags += ["--max-source-positions", str(int(ts.get("max_source_positions") or 1024))]
    if ts.get("no_scale_embedding", True):
        flags.append("--no-scale-embedding")
    if ts.get("layernorm_embedding"):
        flags.append("--layernorm-embedding")
    if ts.get("xpos_rel_pos"):
        flags.append("--xpos")
    if encdec and (bool(ts.get("share_all_embeddings")) or weights["encoder.embed_tokens.weight"].data_ptr()
                   == weights["decoder.embed_tokens.weight"].data_ptr()):
        flags.append("--share-all-embeddings")
    elif tied:
        flags.append("--share-decoder-input-output-embed")
    if is_moe(ts):
        flags += moe_flags(ts)
    if positions == "none" and "decoder.embed_positions.weight" not in weights:
        flags.append("--no-token-positional-embeddings")
    return flags


def _check_dictionary(path: str, weights: dict[str, torch.Tensor], side: str) -> None:
    if not os.path.isfile(path):
        raise TsConfigError(f"{path} does not exist: --data is the fairseq data directory the model will read")
    rows, entries = weights[f"{side}.embed_tokens.weight"].size(0), len(Dictionary.load(path))
    if entries != rows:
        raise TsConfigError(f"{path} has {entries} entries but the {side} embedding {rows} rows: "
                            "use the dictionary the TorchScale model was trained with")


def import_torchscale(source: str, output: str, data: str, positions: str = "none",
                      langs: tuple[str, str] | None = None) -> list[str]:
    """Write the ``ts_lm`` (a ``Decoder``) or ``ts_transformer`` (an ``EncoderDecoder``) checkpoint
    ``output`` of the TorchScale checkpoint ``source``; returns the ``fairseq-train`` model flags that
    continue training it (``--arch ts_lm FLAGS --restore-file OUTPUT``, or ``ts_transformer``).
    ``data``: the fairseq data directory (``dict.txt``, or ``dict.SRC.txt`` and ``dict.TGT.txt`` for
    ``langs = (SRC, TGT)``, one entry per embedding row); ``positions``: ``none`` or ``sinusoidal``
    when the checkpoint has no learned position table."""
    if positions not in POSITIONS:
        raise TsConfigError(f"--positions {positions!r} is unknown: choose one of {', '.join(POSITIONS)}")
    if os.path.exists(output):
        raise TsConfigError(f"{output} already exists: choose a new checkpoint name (nothing was written)")
    if not os.path.isfile(source):
        raise TsConfigError(f"no checkpoint {source}: check the path")
    state = read_checkpoint(source)
    ts, weights = torchscale_config(state), torchscale_weights(state)
    _refuse_unsupported(ts, weights, positions)
    if is_encoder_decoder(weights):
        if langs is None:
            raise TsConfigError("an EncoderDecoder needs --source-lang and --target-lang (dict.SRC.txt and "
                                "dict.TGT.txt in --data)")
        for side, lang in zip(("encoder", "decoder"), langs):
            _check_dictionary(os.path.join(data, f"dict.{lang}.txt"), weights, side)
        task = ["--task", "translation", "--source-lang", langs[0], "--target-lang", langs[1],
                "--arch", "ts_transformer"]
    else:
        _check_dictionary(os.path.join(data, "dict.txt"), weights, "decoder")
        task = ["--task", "language_modeling", "--arch", "ts_lm"]
    out_proj = weights.get("decoder.output_projection.weight")
    tied = out_proj is None or out_proj.data_ptr() == weights["decoder.embed_tokens.weight"].data_ptr() or bool(
        ts.get("share_decoder_input_output_embed"))
    flags = model_flags(ts, weights, positions, tied)
    max_positions = flags[flags.index("--max-target-positions") + 1]
    argv = [data, "--user-dir", PLUGIN_DIR, *task, *flags]
    if not is_encoder_decoder(weights):
        argv += ["--tokens-per-sample", max_positions]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    new_state = {
        "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "args": None,
        "model": ts_weights(weights, tied),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "none",
                               "lr_scheduler_state": {}, "num_updates": 0}],
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0}},
        "last_optimizer_state": None,
    }
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    checkpoint_utils.torch_persistent_save(new_state, output)
    return flags
