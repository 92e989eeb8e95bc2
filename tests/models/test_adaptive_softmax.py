"""ts_lm with fairseq transformer_lm's adaptive input / adaptive softmax flags.

References: the adaptive softmax formula written out from the module weights (Grave et al. 2017:
log p(w) = log p(cluster(w) | h) + log p(w | cluster, h), the head scoring the first band's words
and one logit per tail cluster), the training criterion ``adaptive_loss`` against the scorer's
``get_normalized_probs``, stock fairseq ``transformer_lm`` with the same flags (same adaptive
parameter shapes), and the console tools (train, eval-lm, sampling) on tiny data.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fairseq.criterions.adaptive_loss import AdaptiveLoss
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture

from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, json_logs, last_error_line, run_many, tool
from tests.helpers.model_utils import FakeTask, build, dictionary
from torchscale_fairseq.errors import TsConfigError

VOCAB = dictionary(60)  # 64 entries after fairseq's padding to a multiple of 8
CUTOFF = "12,30"
ADAPTIVE = dict(share_decoder_input_output_embed=False, adaptive_softmax_cutoff=CUTOFF, adaptive_input_cutoff=CUTOFF,
                adaptive_input=True, tie_adaptive_weights=True, tie_adaptive_proj=True, adaptive_softmax_factor=2,
                adaptive_input_factor=2)


def _model(**overrides):
    torch.manual_seed(0)
    model = build("lm", VOCAB, **{**ADAPTIVE, **overrides})
    return model.eval()


def _reference_log_probs(model, h: torch.Tensor) -> torch.Tensor:
    """log p(w | h) for every word, written out from the tied adaptive input weights."""
    bands = model.decoder.embed.embed_tokens.embeddings  # band i: Embedding E_i, Linear P_i (dim_i -> d)
    cuts = [0, 12, 30, len(VOCAB)]
    head_words = h @ bands[0][0].weight.t()
    class_logits = h @ model.decoder.adaptive_softmax.head.class_proj.weight.t()
    head = F.log_softmax(torch.cat([head_words, class_logits], -1), -1)
    out = [head[..., : cuts[1]]]
    for i in (1, 2):
        emb, proj = bands[i][0].weight, bands[i][1].weight
        tail = F.log_softmax((h @ proj) @ emb.t(), -1)
        out.append(head[..., cuts[1] + i - 1 : cuts[1] + i] + tail)
    return torch.cat(out, -1)


def test_adaptive_softmax_log_probs_follow_the_formula_and_sum_to_one() -> None:
    model = _model()
    tokens = torch.randint(4, len(VOCAB), (2, 7))
    with torch.no_grad():
        features, extra = model(tokens)
        assert features.shape == (2, 7, 64)  # the decoder hands the features to the adaptive softmax
        log_p = model.get_normalized_probs((features, extra), log_probs=True)
        expected = _reference_log_probs(model, features)
    assert log_p.shape == (2, 7, len(VOCAB))
    torch.testing.assert_close(log_p, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(log_p.exp().sum(-1), torch.ones(2, 7), atol=1e-5, rtol=0)


def test_adaptive_loss_equals_the_scorers_negative_log_likelihood() -> None:
    """Training loss (``adaptive_loss``: per-cluster cross-entropies) = -sum log p(target) as
    fairseq-eval-lm scores it (``get_normalized_probs`` with the sample's targets). Words 13 and 31
    are left out: stock ``adaptive_loss`` passes ``ignore_index=pad`` (1) to every cluster's
    cross-entropy, so the tail word whose index *inside its cluster* is 1 is never counted."""
    model = _model()
    words = torch.tensor([w for w in range(4, len(VOCAB)) if w not in (13, 31)])
    tokens = words[torch.randint(len(words), (3, 9))]
    source, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    sample = {"net_input": {"src_tokens": source}, "target": target, "ntokens": 24}
    criterion = AdaptiveLoss(FakeTask(VOCAB), sentence_avg=False)
    with torch.no_grad():
        loss, sample_size, _ = criterion(model, sample)
        log_p = model.get_normalized_probs(model(source), log_probs=True, sample=sample)
    nll = -log_p.gather(-1, target[..., None]).sum()
    assert sample_size == 24
    torch.testing.assert_close(loss.squeeze(), nll, atol=1e-4, rtol=1e-5)


def test_adaptive_parameters_match_stock_transformer_lm() -> None:
    """Same flags, same adaptive input / softmax parameters (names and shapes) as fairseq's model."""
    ns = argparse.Namespace(decoder_embed_dim=64, decoder_input_dim=64, decoder_output_dim=64, decoder_layers=1,
                            tokens_per_sample=64, max_target_positions=64, **ADAPTIVE)
    base_lm_architecture(ns)
    stock = TransformerLanguageModel.build_model(ns, FakeTask(VOCAB))
    ours = _model()

    def adaptive(model, prefix: str) -> dict:
        return {name.removeprefix(prefix): tuple(p.shape) for name, p in model.named_parameters()
                if name.startswith(prefix)}

    assert adaptive(ours, "decoder.embed.embed_tokens.") == adaptive(stock, "decoder.embed_tokens.")
    assert adaptive(ours, "decoder.adaptive_softmax.") == adaptive(stock, "decoder.adaptive_softmax.")
    assert adaptive(ours, "decoder.adaptive_softmax.") == {"head.class_proj.weight": (2, 64)}  # the rest is tied


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"share_decoder_input_output_embed": True}, "--tie-adaptive-weights"),
        ({"adaptive_softmax_cutoff": None, "tie_adaptive_weights": False, "tie_adaptive_proj": False},
         "needs --adaptive-softmax-cutoff"),
        ({"adaptive_softmax_cutoff": "30,12", "adaptive_input_cutoff": "30,12"}, "increasing"),
        ({"adaptive_softmax_cutoff": "12,a", "adaptive_input_cutoff": "12,a"}, "comma separated"),
        ({"adaptive_softmax_cutoff": "12,300", "adaptive_input_cutoff": "12,300"}, "vocabulary size 64"),
        ({"adaptive_input_factor": 4}, "--adaptive-input-factor"),
        ({"tie_adaptive_weights": False}, "--tie-adaptive-proj needs"),
        ({"model_parallel_size": 2}, "not tensor-parallel"),
    ],
)
def test_adaptive_flag_combinations_ts_lm_cannot_honour_are_one_line_errors(overrides, message) -> None:
    with pytest.raises(TsConfigError, match=message):
        _model(**overrides)


def test_untied_adaptive_softmax_on_plain_embeddings_scores_a_distribution() -> None:
    model = _model(adaptive_input=False, tie_adaptive_weights=False, tie_adaptive_proj=False)
    with torch.no_grad():
        log_p = model.get_normalized_probs(model(torch.randint(4, len(VOCAB), (1, 5))), log_probs=True)
    torch.testing.assert_close(log_p.exp().sum(-1), torch.ones(1, 5), atol=1e-5, rtol=0)


def test_adaptive_lm_trains_scores_and_samples_from_the_cli(lm_data: Path, tmp_path: Path) -> None:
    """fairseq-train with adaptive_loss (loss falls), fairseq-eval-lm on its checkpoint (perplexity
    = 2 ** base-2 loss, below the uniform 64), sampling through the hub, and the tied-softmax
    mix-up refused as one line from the CLI."""
    save = tmp_path / "ckpt"
    train = ["--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--decoder-embed-dim", "32",
             "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2", "--criterion", "adaptive_loss",
             "--adaptive-softmax-cutoff", "20", "--ddp-backend", "legacy_ddp"]
    flags = [flag for flag in LM_TRAIN if flag != "--share-decoder-input-output-embed"]
    trained, refused = run_many([
        [tool("fairseq-train"), lm_data, *train, *flags, "--adaptive-input", "--tie-adaptive-weights",
         "--tie-adaptive-proj", "--max-update", "20", "--save-dir", save],
        [tool("fairseq-train"), lm_data, *train, *LM_TRAIN, "--max-update", "1", "--save-dir", tmp_path / "bad"],
    ], check=False)
    assert trained.returncode == 0, trained.stderr[-3000:]
    losses = [float(r["loss"]) for r in json_logs(trained.stdout + trained.stderr, "train_inner")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses
    assert refused.returncode != 0 and "--tie-adaptive-weights" in last_error_line(refused)
    hub = ("import torch, torchscale_fairseq\n"
           "from torchscale_fairseq.models.lm import TsLanguageModel\n"
           f"hub = TsLanguageModel.from_pretrained({str(save)!r}, 'checkpoint_last.pt', {str(lm_data)!r})\n"
           "torch.manual_seed(0)\n"
           "out = hub.generate([torch.tensor([5, 6])], beam=1, sampling=True, sampling_topk=5, max_len_b=6)\n"
           "print('generated', out[0][0]['tokens'].tolist())\n")
    evaluate, sample = run_many([
        [tool("fairseq-eval-lm"), lm_data, "--user-dir", USER_DIR, "--path", save / "checkpoint_last.pt",
         "--gen-subset", "valid", "--tokens-per-sample", "32", "--batch-size", "8", "--cpu"],
        [sys.executable, "-c", hub],
    ])
    log = evaluate.stdout + evaluate.stderr
    loss = float(log.split("Loss (base 2): ")[1].split(",")[0])
    ppl = float(log.split("Perplexity: ")[1].split()[0])
    assert math.isclose(ppl, 2**loss, rel_tol=1e-3) and ppl < 64
    assert "generated [5, 6," in sample.stdout
