"""Export a ``ts_lm``, ``ts_mlm`` or ``ts_transformer`` checkpoint to a Hugging Face ``transformers`` folder.

Two formats:
- ``ts`` (every ``ts_lm``, ``ts_mlm`` and ``ts_transformer``): ``config.json`` (``auto_map`` to the modeling code in the
  folder), ``model.safetensors`` (or shards plus ``model.safetensors.index.json`` above
  ``max_shard_size``), ``configuration_ts_lm.py`` / ``modeling_ts_lm.py`` (self-contained,
  :mod:`torchscale_fairseq.interop.hf_modeling`; a ``ts_mlm`` adds ``configuration_ts_mlm.py`` /
  ``modeling_ts_mlm.py``, which import them), loaded with ``trust_remote_code=True``.
  A ``ts_lm`` is an ``AutoModelForCausalLM``: parameter names are the fairseq ones with
  ``decoder.`` -> ``model.`` and ``decoder.output_projection`` (or ``decoder.adaptive_softmax``)
  -> ``lm_head``; an adaptive softmax's copies of tied adaptive input weights are written once, as
  the input's. A ``ts_mlm`` is an ``AutoModelForMaskedLM`` (its encoder an ``AutoModel``):
  ``encoder.encoder.`` -> ``model.``, ``encoder.lm_head_bias`` -> ``lm_head.bias`` (the weight is
  the tied token embedding), ``encoder.lm_head_*`` -> ``lm_head_*``. A ``ts_transformer`` is an
  ``AutoModelForSeq2SeqLM`` (``configuration_ts_transformer.py`` / ``modeling_ts_transformer.py``
  import the other four): ``encoder.`` / ``decoder.`` -> ``model.encoder.`` / ``model.decoder.``
  (without ``embed.``), ``decoder.output_projection`` -> ``lm_head``, the decoder's copy of a
  ``--share-all-embeddings`` table not written; its ``generation_config.json`` is fairseq-generate's
  search (:func:`generation_config`).
- ``gpt2``: a native ``GPT2LMHeadModel`` when the math is GPT-2's: ``--backbone preln``, dense,
  learned positions, gelu or relu, no embedding LayerNorm, no relative positions or xPos, and
  the embedding scale 1 (``--no-scale-embedding``) unless the output embedding is untied
  (then the scale is folded into ``wte``). fairseq's positions start at ``pad + 1``:
  ``wpe`` is the learned table from that row on.

Token ids are always the fairseq dictionary's ids. The folder gets a tokenizer
(:mod:`.hf_tokenizer`) giving those ids for the dictionaries ``data_prep`` makes: a SentencePiece
model's (``--spm-model``, else the one the checkpoint's ``streaming_mlm`` task names, else
``spm.model`` next to the data directory's dictionary, where ``data_prep`` writes it; a
``streaming_mlm`` checkpoint's dictionary is derived from it, as the task derives it), and, for a
``ts_lm``, the GPT-2 BPE dictionary of ``data_prep.prepare_lm`` (fairseq id = GPT-2 id + 4). A
``ts_lm``'s texts start with ``</s>``, the token a fairseq LM is fed first; a ``ts_mlm``'s are
``<s> text </s>``; a ``ts_transformer``'s (one joined dictionary, as ``prepare_nmt`` makes: its target
dictionary ``dict.TGT.txt``) ``text </s>``, a source as fairseq's translation task reads it. Every folder gets a model card,
``README.md`` (:mod:`.hf_card`); the output folder is new, so no file of the user's is ever overwritten.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.interop.checkpoint_files import load_single_process_state
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.models.config import validate_common
from torchscale_fairseq.models.lm import TsLanguageModel, check_adaptive, parse_cutoffs
from torchscale_fairseq.models.mlm import TsMaskedLMModel
from torchscale_fairseq.models.transformer import TsTransformerModel

logger = logging.getLogger(__name__)

MODELING_DIR = Path(__file__).parent / "hf_modeling"
KINDS = {TsLanguageModel: "lm", TsMaskedLMModel: "mlm", TsTransformerModel: "mt"}
ARCHS = {"lm": "ts_lm", "mlm": "ts_mlm", "mt": "ts_transformer"}
LM_FILES = ("configuration_ts_lm.py", "modeling_ts_lm.py")
MLM_FILES = LM_FILES + ("configuration_ts_mlm.py", "modeling_ts_mlm.py")
MODELING_FILES = {"lm": LM_FILES, "mlm": MLM_FILES,
                  "mt": MLM_FILES + ("configuration_ts_transformer.py", "modeling_ts_transformer.py")}
# per kind: the fairseq stack's parameter prefix and StackConfig sides (an encoder-decoder's: its decoder's)
STACKS = {"lm": ("decoder.", "decoder", "decoder_only"), "mlm": ("encoder.encoder.", "encoder", "encoder_only"),
          "mt": ("decoder.", "decoder", "encdec_decoder")}
ENCODER_STACK = ("encoder", "encdec_encoder")  # StackConfig sides of an encoder-decoder's encoder
# per kind: the class config.json names (``architectures``) and its ``auto_map``
AUTO_MAPS = {
    "lm": ("TsLMForCausalLM", {"AutoConfig": "configuration_ts_lm.TsLMConfig",
                               "AutoModelForCausalLM": "modeling_ts_lm.TsLMForCausalLM"}),
    "mlm": ("TsMLMForMaskedLM", {"AutoConfig": "configuration_ts_mlm.TsMLMConfig",
                                 "AutoModel": "modeling_ts_mlm.TsMLMModel",
                                 "AutoModelForMaskedLM": "modeling_ts_mlm.TsMLMForMaskedLM"}),
    "mt": ("TsTransformerForConditionalGeneration",
           {"AutoConfig": "configuration_ts_transformer.TsTransformerConfig",
            "AutoModel": "modeling_ts_transformer.TsTransformerModel",
            "AutoModelForSeq2SeqLM": "modeling_ts_transformer.TsTransformerForConditionalGeneration"}),
}
FORMATS = ("ts", "gpt2")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def recorded_model_options(state: dict[str, Any]) -> dict[str, Any]:
    """The model's fairseq options as the checkpoint records them (``cfg.model`` or legacy ``args``)."""
    cfg = state.get("cfg") or {}
    model = cfg.get("model") if hasattr(cfg, "get") else None
    if model is None:
        model = state.get("args")
    if model is None:
        raise TsConfigError("the checkpoint records no model configuration (cfg.model / args): "
                            "it was not saved by fairseq-train")
    return dict(vars(model) if isinstance(model, argparse.Namespace) else model)


def _task_option(state: dict[str, Any], name: str) -> Any:
    """Option ``name`` of the checkpoint's task (``cfg.task``), ``None`` if not recorded."""
    task = (state.get("cfg") or {}).get("task") or {}
    return task.get(name) if hasattr(task, "get") else getattr(task, name, None)


def recorded_task(state: dict[str, Any]) -> str | None:
    """The name of the task the checkpoint was trained with (``cfg.task._name`` or legacy ``args.task``)."""
    return _task_option(state, "_name") or getattr(state.get("args"), "task", None)


def model_args(state: dict[str, Any]) -> tuple[str, argparse.Namespace]:
    """The model's kind (``lm`` / ``mlm`` / ``mt``) and fairseq args (:func:`recorded_model_options`) with its
    architecture's defaults."""
    fields = recorded_model_options(state)
    arch = fields.get("arch") or fields.get("_name")
    kind = KINDS.get(ARCH_MODEL_REGISTRY.get(arch))
    if kind is None:
        raise TsConfigError(f"architecture {arch!r} is not a ts model: ts-export-hf exports ts_lm_* language models, "
                            "ts_mlm_* masked LMs and ts_transformer_* encoder-decoders")
    args = argparse.Namespace(**fields)
    ARCH_CONFIG_REGISTRY[arch](args)
    if kind == "lm":
        check_adaptive(args)
        if getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = args.tokens_per_sample
    validate_common(args)
    return kind, args


def _data_file(state: dict[str, Any], name: str) -> str | None:
    """File ``name`` of the (first) data directory the checkpoint was trained on, if present."""
    data = _task_option(state, "data")
    path = os.path.join(str(data).split(os.pathsep)[0], name) if data else None
    return path if path and os.path.isfile(path) else None


def checkpoint_dictionary(state: dict[str, Any], dict_path: str | None, kind: str = "lm") -> Dictionary | None:
    """``dict_path``, else the dictionary in the data directory the checkpoint was trained on, if present:
    ``dict.txt``, or a translation model's target dictionary ``dict.{target_lang}.txt``."""
    if dict_path is None:
        dict_path = _data_file(state, f"dict.{_task_option(state, 'target_lang')}.txt" if kind == "mt" else "dict.txt")
        if dict_path is None:
            return None
    if not os.path.isfile(dict_path):
        raise TsConfigError(f"dictionary {dict_path} does not exist: pass the dict.txt the model was trained with")
    return Dictionary.load(dict_path)


def joined_dictionary(state: dict[str, Any], dictionary: Dictionary) -> bool:
    """Whether a translation model's source dictionary (``dict.{source_lang}.txt`` of its data directory)
    is its target ``dictionary`` (``fairseq-preprocess --joined-dictionary``)."""
    path = _data_file(state, f"dict.{_task_option(state, 'source_lang')}.txt")
    return path is not None and Dictionary.load(path).symbols == dictionary.symbols


def checkpoint_spm_model(state: dict[str, Any], spm_model: str | None) -> Path | None:
    """``spm_model``, else the ``--spm-model`` of the checkpoint's task, else ``spm.model`` of its data
    directory, if present."""
    if spm_model is not None and not os.path.isfile(spm_model):
        raise TsConfigError(f"SentencePiece model {spm_model} does not exist: pass the .model file the "
                            "training data was encoded with (--spm-model)")
    recorded = _task_option(state, "spm_model")
    path = spm_model or (recorded if recorded and os.path.isfile(recorded) else _data_file(state, "spm.model"))
    return Path(path) if path else None


def _mlm_name(name: str) -> str | None:
    """The exported name of ``ts_mlm`` parameter ``name`` (``None``: not exported)."""
    if not name.startswith("encoder."):
        return None
    rest = name[len("encoder."):]
    if rest == "lm_head_bias":
        return "lm_head.bias"
    if rest.startswith("lm_head_"):
        return rest
    return "model." + rest[len("encoder."):].removeprefix("embed.")


def _mt_name(name: str, share_all: bool) -> str | None:
    """The exported name of ``ts_transformer`` parameter ``name`` (``None``: not exported: the decoder's
    copy of a shared embedding)."""
    side, _, rest = name.partition(".")
    if side not in ("encoder", "decoder") or (share_all and name == "decoder.embed.embed_tokens.weight"):
        return None
    if name == "decoder.output_projection.weight":
        return "lm_head.weight"
    return f"model.{side}." + rest.removeprefix("embed.")


def _hf_name(name: str, args: argparse.Namespace, kind: str) -> str | None:
    """The exported name of fairseq parameter ``name`` (``None``: not exported: buffers, the
    training-only noise projection, and the adaptive softmax's copies of tied adaptive input weights)."""
    if name.endswith((".version", "._float_tensor")) or ".noise_proj." in name:
        return None
    if kind == "mlm":
        return _mlm_name(name)
    if kind == "mt":
        return _mt_name(name, bool(getattr(args, "share_all_embeddings", False)))
    if (not name.startswith("decoder.") or name == "decoder.adaptive_softmax.head.word_proj.weight"
            or (args.tie_adaptive_weights and re.fullmatch(r"decoder\.adaptive_softmax\.tail\.\d+\.2\.weight", name))
            or (args.tie_adaptive_proj and re.fullmatch(r"decoder\.adaptive_softmax\.tail\.\d+\.0\.weight", name))):
        return None
    rest = name[len("decoder."):]
    if rest == "output_projection.weight":
        return "lm_head.weight"
    if rest.startswith("adaptive_softmax."):
        return "lm_head." + rest[len("adaptive_softmax."):]
    if rest.startswith("embed."):
        rest = rest[len("embed."):]
    return "model." + rest


def ts_tensors(weights: dict[str, torch.Tensor], args: argparse.Namespace, kind: str) -> dict[str, torch.Tensor]:
    """The fairseq parameters under their exported names (format ``ts``)."""
    out = {}
    for name, tensor in weights.items():
        new = _hf_name(name, args, kind)
        if new is not None:
            out[new] = tensor
    return out


def adaptive_options(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The adaptive input / softmax options of :class:`TsLMConfig`: cutoffs as band edges ending at
    ``vocab`` (fairseq's ``AdaptiveInput`` / ``AdaptiveSoftmax`` append it), the input's defaulting
    to the softmax's."""

    def edges(text: str | None, flag: str) -> list[int] | None:
        cutoffs = parse_cutoffs(text, vocab, flag)
        return cutoffs if cutoffs is None or cutoffs[-1] == vocab else cutoffs + [vocab]

    softmax = edges(args.adaptive_softmax_cutoff, "--adaptive-softmax-cutoff")
    inputs = (edges(args.adaptive_input_cutoff, "--adaptive-input-cutoff") or softmax) if args.adaptive_input else None
    return {"adaptive_input_cutoff": inputs, "adaptive_input_factor": float(args.adaptive_input_factor),
            "adaptive_softmax_cutoff": softmax, "adaptive_softmax_factor": float(args.adaptive_softmax_factor),
            "adaptive_softmax_dropout": float(args.adaptive_softmax_dropout),
            "tie_adaptive_weights": bool(args.tie_adaptive_weights), "tie_adaptive_proj": bool(args.tie_adaptive_proj)}


def vocab_size(weights: dict[str, torch.Tensor], kind: str) -> int:
    """Rows of the input embedding (summed over the bands of an adaptive input)."""
    table = f"{STACKS[kind][0]}embed.embed_tokens.weight"
    if table in weights:
        return weights[table].size(0)
    band = re.compile(r"decoder\.embed\.embed_tokens\.embeddings\.\d+\.0\.weight")
    return sum(t.size(0) for name, t in weights.items() if band.fullmatch(name))


def gpt2_refusal(cfg: StackConfig, tied: bool, adaptive: bool) -> str | None:
    """Why ``cfg`` is not a GPT-2 (``None`` when it is)."""
    checks = [
        (adaptive, "an adaptive input or adaptive softmax"),
        (cfg.backbone.name != "preln", f"--backbone {cfg.backbone.name} (GPT-2 is preln)"),
        (cfg.moe is not None, "X-MoE layers"),
        (cfg.positions != "learned", f"{cfg.positions} positions (GPT-2 learns them: --decoder-learned-pos)"),
        (cfg.activation not in ("gelu", "relu"), f"--activation-fn {cfg.activation}"),
        (cfg.layernorm_embedding, "--layernorm-embedding"),
        (cfg.rel_pos_buckets > 0, "--rel-pos-buckets"),
        (cfg.xpos, "--xpos"),
        (tied and cfg.scale_embedding, "a scaled tied embedding (train with --no-scale-embedding or untie it)"),
    ]
    reasons = [why for bad, why in checks if bad]
    return "; ".join(reasons) if reasons else None


def gpt2_tensors(weights: dict[str, torch.Tensor], cfg: StackConfig, pad: int) -> dict[str, torch.Tensor]:
    """GPT-2's parameters (``Conv1D`` weights are ``(in, out)``: transposed ``nn.Linear`` weights)."""
    scale = math.sqrt(cfg.embed_dim) if cfg.scale_embedding else 1.0
    out = {
        "transformer.wte.weight": weights["decoder.embed.embed_tokens.weight"] * scale,
        "transformer.wpe.weight": weights["decoder.embed.embed_positions.weight"][pad + 1:],
        "transformer.ln_f.weight": weights["decoder.layer_norm.weight"],
        "transformer.ln_f.bias": weights["decoder.layer_norm.bias"],
    }
    if "decoder.output_projection.weight" in weights:
        out["lm_head.weight"] = weights["decoder.output_projection.weight"]
    pairs = [("self_attn_layer_norm", "ln_1"), ("final_layer_norm", "ln_2")]
    linears = [("self_attn.qkv_proj", "attn.c_attn"), ("self_attn.out_proj", "attn.c_proj"),
               ("ffn.fc1", "mlp.c_fc"), ("ffn.fc2", "mlp.c_proj")]
    for i in range(cfg.layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for a, b in pairs:
            out[f"{dst}{b}.weight"] = weights[f"{src}{a}.weight"]
            out[f"{dst}{b}.bias"] = weights[f"{src}{a}.bias"]
        for a, b in linears:
            out[f"{dst}{b}.weight"] = weights[f"{src}{a}.weight"].t()
            out[f"{dst}{b}.bias"] = weights[f"{src}{a}.bias"]
    return out


def stack_options(cfg: StackConfig, vocab: int) -> dict[str, Any]:
    """The :class:`TsLMConfig` options in which the two stacks of an encoder-decoder may differ."""
    return dict(vocab_size=vocab, hidden_size=cfg.embed_dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.layers,
                num_attention_heads=cfg.attention_heads, residual_alpha=cfg.backbone.alpha, positions=cfg.positions,
                max_position_embeddings=cfg.max_positions,
                embed_scale=math.sqrt(cfg.embed_dim) if cfg.scale_embedding else 1.0)


def ts_config(cfg: StackConfig, vocab: int, tied: bool, specials: dict[str, int], extra: dict[str, Any],
              kind: str = "lm"):
    """The ``TsLMConfig`` (``kind`` ``lm``), ``TsMLMConfig`` (``mlm``) or ``TsTransformerConfig`` (``mt``:
    ``cfg`` is the decoder's) of ``cfg``; ``extra``: the kind's own options (adaptive input / softmax;
    ``mask_token_id``; the encoder's options)."""
    from torchscale_fairseq.interop.hf_modeling.configuration_ts_lm import TsLMConfig
    from torchscale_fairseq.interop.hf_modeling.configuration_ts_mlm import TsMLMConfig
    from torchscale_fairseq.interop.hf_modeling.configuration_ts_transformer import TsTransformerConfig

    moe = cfg.moe
    config = {"lm": TsLMConfig, "mlm": TsMLMConfig, "mt": TsTransformerConfig}[kind](
        **stack_options(cfg, vocab), backbone=cfg.backbone.name, activation=cfg.activation,
        layernorm_embedding=cfg.layernorm_embedding, layer_norm_eps=cfg.layernorm_eps,
        rel_pos_buckets=cfg.rel_pos_buckets, max_rel_pos=cfg.max_rel_pos, xpos=cfg.xpos,
        dropout=cfg.dropout, attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
        moe_expert_count=moe.expert_count if moe else 0, moe_freq=moe.freq if moe else 2,
        moe_top_k=moe.top_k if moe else 2, moe_router=moe.router if moe else "xmoe",
        moe_router_dim=moe.router_dim if moe else 16,
        moe_expert_ffn_dim=moe.expert_ffn_dim if moe else 0,
        moe_shared_expert_count=moe.shared_expert_count if moe else 0,
        moe_router_bias=bool(moe and moe.router_bias_update_rate > 0),
        moe_eval_capacity_factor=moe.eval_capacity_factor if moe else 0.0,
        moe_normalize_gate_prob_before_dropping=moe.normalize_gate_prob_before_dropping if moe else False,
        tie_word_embeddings=tied, **extra, **specials,
    )
    architecture, config.auto_map = AUTO_MAPS[kind]
    config.architectures = [architecture]
    return config


def gpt2_config(cfg: StackConfig, vocab: int, tied: bool, specials: dict[str, int]):
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=vocab, n_positions=cfg.max_positions, n_embd=cfg.embed_dim, n_layer=cfg.layers,
        n_head=cfg.attention_heads, n_inner=cfg.ffn_dim, activation_function=cfg.activation,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.attention_dropout,
        layer_norm_epsilon=cfg.layernorm_eps, tie_word_embeddings=tied, **specials,
    )
    config.architectures = ["GPT2LMHeadModel"]
    return config


def save_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> list[str]:
    """``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` plus the index above ``max_shard_bytes``."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous().clone()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names + ["model.safetensors.index.json"]


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``10KB`` or a number of bytes."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise TsConfigError(f"--max-shard-size {text!r} is not a size: write e.g. 5GB, 500MB or 1000000")


def _check_experts(weights: dict[str, torch.Tensor], cfg: StackConfig) -> None:
    if cfg.moe is None:
        return
    if cfg.moe.router == "expert_choice":
        raise TsConfigError("--moe-router expert_choice routes over the whole batch (and cannot decode token by "
                            "token): only token-choice routers (xmoe, linear, torchscale_xmoe) can be exported")
    for name, tensor in weights.items():
        if name.endswith(".experts.fc1_weight") and tensor.size(0) != cfg.moe.expert_count:
            raise TsConfigError(
                f"{name} holds {tensor.size(0)} of {cfg.moe.expert_count} experts: this is one expert shard; "
                "pass the checkpoint name whose -shardR.pt files hold all the experts"
            )


def generation_config(cfg: StackConfig, specials: dict[str, int]):
    """fairseq-generate's search as ``generate()``'s defaults: from ``</s>``, beam 5, length penalty 1,
    done once 5 hypotheses ended, ``</s>`` not first, ``<pad>`` never, at most 200 tokens (``--max-len-b``)
    before ``</s>``."""
    from transformers import GenerationConfig

    return GenerationConfig(
        decoder_start_token_id=specials["eos_token_id"], bos_token_id=specials["bos_token_id"],
        eos_token_id=specials["eos_token_id"], pad_token_id=specials["pad_token_id"], num_beams=5, length_penalty=1.0,
        early_stopping=True, min_new_tokens=1, suppress_tokens=[specials["pad_token_id"]],
        max_new_tokens=min(200, cfg.max_positions - 1) + 1,
    )


def export_hf(checkpoint: str, out_dir: str, fmt: str = "ts", dict_path: str | None = None,
              max_shard_size: str = "5GB", dtype: str | None = None, spm_model: str | None = None) -> list[str]:
    """Write the export of ``checkpoint`` to the new folder ``out_dir``; returns the files written."""
    from torchscale_fairseq.data.document_encoders import MASK_SYMBOL, load_sentencepiece, sentencepiece_dictionary
    from torchscale_fairseq.interop.hf_card import model_card
    from torchscale_fairseq.interop.hf_tokenizer import is_gpt2_dictionary, save_gpt2_tokenizer, save_spm_tokenizer

    if fmt not in FORMATS:
        raise TsConfigError(f"--format {fmt!r} is unknown: choose one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise TsConfigError(f"--dtype {dtype!r} is unknown: choose one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists():
        raise TsConfigError(f"{out_dir} already exists: choose a new output folder (nothing was written)")
    max_bytes = parse_size(max_shard_size)
    state = load_single_process_state(checkpoint)
    kind, args = model_args(state)
    if fmt == "gpt2" and kind != "lm":
        raise TsConfigError(f"--format gpt2 exports ts_lm language models only: export a {ARCHS[kind]} with --format ts")
    cfg = StackConfig.from_args(args, *STACKS[kind][1:], ParallelContext.single_process())
    weights = {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    _check_experts(weights, cfg)
    vocab = vocab_size(weights, kind)
    dictionary = checkpoint_dictionary(state, dict_path, kind)
    spm_path = checkpoint_spm_model(state, spm_model)
    if dictionary is None and spm_path is not None and recorded_task(state) == "streaming_mlm":
        dictionary = sentencepiece_dictionary(load_sentencepiece(spm_path))
    if dictionary is not None and kind == "mlm" and recorded_task(state) == "masked_lm":
        dictionary.add_symbol(MASK_SYMBOL)  # as fairseq's masked_lm task adds it to dict.txt's symbols
    if dictionary is not None and len(dictionary) != vocab:
        raise TsConfigError(f"the dictionary has {len(dictionary)} entries but the checkpoint's embedding "
                            f"{vocab}: pass the dict.txt the model was trained with (--dict)")
    pad = dictionary.pad() if dictionary is not None else 1
    eos = dictionary.eos() if dictionary is not None else 2
    specials = {"pad_token_id": pad, "eos_token_id": eos, "bos_token_id": eos}
    encoder = None
    if kind == "mlm":  # fairseq's masked_lm task starts each sample with <s> and masks with <mask>
        mask = dictionary.index(MASK_SYMBOL) if dictionary is not None and MASK_SYMBOL in dictionary.indices else None
        specials["bos_token_id"] = dictionary.bos() if dictionary is not None else 0
        tensors = ts_tensors(weights, args, kind)
        config = ts_config(cfg, vocab, True, specials, {"mask_token_id": mask}, kind)
    elif kind == "mt":
        encoder = StackConfig.from_args(args, *ENCODER_STACK, ParallelContext.single_process())
        extra = {"encoder_stack": stack_options(encoder, weights["encoder.embed.embed_tokens.weight"].size(0)),
                 "share_all_embeddings": bool(getattr(args, "share_all_embeddings", False)),
                 "decoder_start_token_id": eos}
        tensors = ts_tensors(weights, args, kind)
        config = ts_config(cfg, vocab, "decoder.output_projection.weight" not in weights, specials, extra, kind)
    else:
        adaptive = adaptive_options(args, vocab)
        tied = "decoder.output_projection.weight" not in weights and adaptive["adaptive_softmax_cutoff"] is None
        if fmt == "gpt2":
            reason = gpt2_refusal(cfg, tied, adaptive["adaptive_softmax_cutoff"] is not None)
            if reason is not None:
                raise TsConfigError(f"--format gpt2 cannot express {reason}: export with --format ts")
            if pad != 1:
                raise TsConfigError(f"--format gpt2 needs the padding index 1 (the dictionary has {pad}): "
                                    "use --format ts")
            tensors, config = gpt2_tensors(weights, cfg, pad), gpt2_config(cfg, vocab, tied, specials)
        else:
            tensors, config = ts_tensors(weights, args, kind), ts_config(cfg, vocab, tied, specials, adaptive)
    if dtype is not None:
        tensors = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in tensors.items()}
    config.dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        written = save_safetensors(tensors, staging, max_bytes)
        config.save_pretrained(str(staging))
        written.append("config.json")
        if kind == "mt":
            generation_config(cfg, specials).save_pretrained(str(staging))
            written.append("generation_config.json")
        if fmt == "ts":
            for name in MODELING_FILES[kind]:
                shutil.copyfile(MODELING_DIR / name, staging / name)
            written.extend(MODELING_FILES[kind])
        tokenizer = None
        if dictionary is not None and spm_path is not None and (kind != "mt" or joined_dictionary(state, dictionary)):
            try:
                written.extend(save_spm_tokenizer(dictionary, spm_path, kind, staging, cfg.max_positions))
                tokenizer = "SentencePiece"
            except TsConfigError as err:
                if spm_model is not None:
                    raise
                logger.warning("no tokenizer written for the SentencePiece model found at %s: %s", spm_path, err)
        elif kind == "lm" and dictionary is not None and is_gpt2_dictionary(dictionary):
            tokenizer = "GPT-2"
            written.extend(save_gpt2_tokenizer(dictionary, staging, cfg.max_positions))
        card = model_card(kind, fmt, cfg, tensors, recorded_model_options(state), recorded_task(state), dictionary,
                          vocab, tokenizer, encoder)
        (staging / "README.md").write_text(card)
        written.append("README.md")
        if out.exists():
            raise TsConfigError(f"{out_dir} appeared while exporting: choose a new output folder")
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written
