"""The model card (``README.md``) of an exported folder: the architecture and backbone, the parameter
counts (dense, expert), the training configuration the checkpoint records, the ids and tokenizer, and
how to load the folder."""

from __future__ import annotations

from typing import Any

import torch
from fairseq.data import Dictionary

from torchscale_fairseq.architecture.config import StackConfig

WHAT = {"lm": "A decoder-only causal language model (`ts_lm`)",
        "mlm": "A bidirectional encoder with a BERT masked-LM head (`ts_mlm`)",
        "mt": "An encoder-decoder translation model (`ts_transformer`)"}
TAGS = {"lm": "causal-lm", "mlm": "masked-lm", "mt": "translation"}


def parameter_counts(tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(dense, expert)`` numbers of exported parameters: expert = the stacked expert weights
    (names with ``.experts.``), dense = the rest (a tied embedding counted once, as written)."""
    expert = sum(t.numel() for name, t in tensors.items() if ".experts." in name)
    return sum(t.numel() for t in tensors.values()) - expert, expert


def _stack(cfg: StackConfig) -> str:
    """One sentence on the stack: sizes, backbone, positions, experts."""
    backbone = f"`{cfg.backbone.name}`" + (f" (residual alpha {cfg.backbone.alpha:g})" if cfg.backbone.alpha != 1 else "")
    extras = [f"{cfg.positions} absolute positions"]
    if cfg.rel_pos_buckets > 0:
        extras.append(f"T5 relative position bias ({cfg.rel_pos_buckets} buckets)")
    if cfg.xpos:
        extras.append("xPos")
    if cfg.layernorm_embedding:
        extras.append("embedding LayerNorm")
    text = (f"{cfg.layers} layers, hidden size {cfg.embed_dim}, {cfg.attention_heads} heads, FFN {cfg.ffn_dim} "
            f"({cfg.activation}), backbone {backbone}, {', '.join(extras)}.")
    if cfg.moe is not None:
        layers = ", ".join(str(i + 1) for i in range(cfg.layers) if cfg.moe.is_moe_layer(i))
        text += (f" Mixture of experts: {cfg.moe.expert_count} experts in layer(s) {layers} (from 1), "
                 f"top-{cfg.moe.top_k}, `{cfg.moe.router}` router.")
    return text


def _ids(dictionary: Dictionary | None, vocab: int, tokenizer: str | None, kind: str) -> str:
    if dictionary is None:
        ids = (f"Token ids are the fairseq dictionary's ({vocab} rows); the export found no `dict.txt` "
               "(`ts-export-hf --dict` names it).")
    else:
        specials = ", ".join(f"`{s}`={dictionary.index(s)}" for s in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
                             if s in dictionary.indices)
        ids = f"Token ids are the fairseq dictionary's: {len(dictionary)} entries, {specials}."
    frame = {"lm": "started with `</s>` as a fairseq LM is fed", "mlm": "framed as `<s> text </s>`",
             "mt": "ended with `</s>` as fairseq's translation sources are"}[kind]
    if tokenizer is not None:
        what = "byte-level BPE (GPT-2 id + 4)" if tokenizer == "GPT-2" else "model of the training data"
        return ids + f" `tokenizer.json`: the {tokenizer} {what} giving these ids, each text {frame}."
    return ids + (" No tokenizer: encode text as the training data was encoded (its BPE), map the pieces to "
                  f"ids with the fairseq dictionary, each sample {frame}.")


def _load(kind: str, fmt: str) -> str:
    if fmt == "gpt2":
        return 'from transformers import GPT2LMHeadModel\nmodel = GPT2LMHeadModel.from_pretrained("FOLDER")'
    if kind == "lm":
        return ('from transformers import AutoModelForCausalLM\n'
                'model = AutoModelForCausalLM.from_pretrained("FOLDER", trust_remote_code=True)\n'
                'out = model.generate(input_ids, max_new_tokens=20, do_sample=False)')
    if kind == "mt":
        return ('from transformers import AutoModelForSeq2SeqLM\n'
                'model = AutoModelForSeq2SeqLM.from_pretrained("FOLDER", trust_remote_code=True)\n'
                'out = model.generate(input_ids)  # fairseq-generate\'s defaults: beam 5, length penalty 1')
    return ('from transformers import AutoModel, AutoModelForMaskedLM\n'
            'mlm = AutoModelForMaskedLM.from_pretrained("FOLDER", trust_remote_code=True)  # .logits\n'
            'encoder = AutoModel.from_pretrained("FOLDER", trust_remote_code=True)  # .last_hidden_state')


def model_card(kind: str, fmt: str, cfg: StackConfig, tensors: dict[str, torch.Tensor], recorded: dict[str, Any],
               task: str | None, dictionary: Dictionary | None, vocab: int, tokenizer: str | None,
               encoder: StackConfig | None = None) -> str:
    """The ``README.md`` text of a folder exported from a ``kind`` (``lm`` / ``mlm`` / ``mt``) checkpoint;
    ``recorded``: its ``cfg.model`` as saved, ``task``: its task's name, ``vocab``: its (output) embedding's
    rows, ``tokenizer``: the tokenizer written (``GPT-2`` / ``SentencePiece``), ``None`` if none;
    ``encoder``: an encoder-decoder's encoder (``cfg`` is then its decoder)."""
    dense, expert = parameter_counts(tensors)
    arch = recorded.get("arch") or recorded.get("_name")
    stacks = _stack(cfg) if encoder is None else f"Encoder: {_stack(encoder)} Decoder: {_stack(cfg)}"
    options = "\n".join(f"{k} = {v!r}" for k, v in sorted(recorded.items()) if v is not None and not k.startswith("_"))
    return f"""---
library_name: transformers
tags: [torchscale-fairseq, {TAGS[kind]}]
---

# `{arch}`, exported from torchscale-fairseq

**Architecture.** {WHAT[kind]}, exported by `ts-export-hf --format {fmt}`: {stacks}

**Parameters.** {dense + expert:,} in all: {dense:,} dense, {expert:,} in experts (counted over the
exported tensors; a tied embedding once).

**Training.** The checkpoint records no command line, only fairseq's parsed configuration: task
`{task}`, model options (`cfg.model`, as saved):

```
{options}
```

**Ids and tokenizer.** {_ids(dictionary, vocab, tokenizer, kind)}

**Loading** (`FOLDER` is this folder; `input_ids` fairseq ids as above):

```python
{_load(kind, fmt)}
```
"""
