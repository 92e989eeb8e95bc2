"""Build ts models directly (no CLI) for unit tests."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from fairseq.data import Dictionary

import torchscale_fairseq  # noqa: F401  (registers the models)
from torchscale_fairseq.criterions.moe_terms import moe_figures
from torchscale_fairseq.models.lm import TsLanguageModel
from torchscale_fairseq.models.mlm import TsMaskedLMModel
from torchscale_fairseq.models.transformer import TsTransformerModel
from torchscale_fairseq.modules.moe.aux_loss import aux_loss_scales, set_aux_loss_scale
from torchscale_fairseq.modules.moe.layer import MoELayer, update_expert_biases


class FakeTask:
    def __init__(self, dictionary: Dictionary) -> None:
        self.source_dictionary = self.target_dictionary = dictionary


def dictionary(n: int = 40) -> Dictionary:
    d = Dictionary()
    for i in range(n):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=8)
    return d


def args(**overrides: Any) -> argparse.Namespace:
    base = dict(
        backbone="magneto", activation_fn="gelu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_layers=2, decoder_attention_heads=4,
        encoder_embed_dim=64, encoder_ffn_embed_dim=128, encoder_layers=2, encoder_attention_heads=4,
        tokens_per_sample=64, max_target_positions=64, max_source_positions=64, max_positions=64,
        share_decoder_input_output_embed=True,
    )
    base.update(overrides)
    return argparse.Namespace(**base)


def build(kind: str, d: Dictionary = None, **overrides: Any):
    cls = {"lm": TsLanguageModel, "mt": TsTransformerModel, "mlm": TsMaskedLMModel}[kind]
    return cls.build_model(args(**overrides), FakeTask(d or dictionary()))


def fairseq_train_model(argv: list[str]):
    """The task and the model ``fairseq-train argv`` builds: from its own typed config (``add_defaults``, as
    fairseq-train's main), whose model fields hold each choice as a ``ChoiceEnum`` member, not a string."""
    from fairseq import options, tasks
    from fairseq.dataclass.initialize import add_defaults
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    add_defaults(cfg)
    assert not isinstance(cfg.model.activation_fn, str)  # the enum members such tests are about
    task = tasks.setup_task(cfg.task)
    return task, task.build_model(cfg.model)


def train_lm(model, updates: list[list[torch.Tensor]], lr: float) -> tuple[list[float], list[dict], list[torch.Tensor]]:
    """Adam over ``updates``, each a list of token batches whose gradients accumulate (``--update-freq``):
    per update the summed cross-entropy (in fp32), per micro-batch its MoE figures, and the first update's
    gradients. As the trainer does, the MoE layers' auxiliary-loss gradients are set before each
    micro-batch (``w`` 0.1, ``w_z`` 0.01, the target tokens as sample size; every second micro-batch of
    an update ignored, as fairseq's dummy batch is: its scales 0) and the expert biases move after each
    update; the figures are read as the criterion reads them."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    losses, figures, first_grads = [], [], []
    for micro_batches in updates:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        sizes = [tokens[:, 1:].numel() for tokens in micro_batches]
        ignored = [i % 2 == 1 for i in range(len(sizes))]
        scales = aux_loss_scales(sizes, ignored, 0.1, 0.01, 1.0, micro_batches[0].device)
        for tokens, scale in zip(micro_batches, scales):
            set_aux_loss_scale(moe_layers, scale)
            logits, extra = model(tokens[:, :-1])
            moe_figures(extra["moe"], scale.sample_size, logged := {})
            figures.append(logged)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            total += float(loss)
        set_aux_loss_scale(moe_layers, None)
        if not first_grads:
            first_grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        update_expert_biases(model, None)
        losses.append(total)
    return losses, figures, first_grads
