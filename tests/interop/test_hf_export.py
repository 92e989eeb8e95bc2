"""``ts-export-hf``: the exported folder, loaded by ``transformers`` offline, computes what the
fairseq model computes (next-token logits; greedy and beam-5 decoding with the KV cache against
fairseq's ``SequenceGenerator``), for every backbone, dense and X-MoE, and with fairseq's adaptive
input / adaptive softmax (log-probabilities; greedy decoding); an exported ``ts_mlm`` computes the
fairseq masked LM's logits (``AutoModelForMaskedLM``) and encoder output (``AutoModel``), for every
backbone, dense and X-MoE; the exported tokenizers (GPT-2 BPE; SentencePiece of ``prepare_lm
--spm-vocab``, ``prepare_nmt`` and ``train_spm``) give the fairseq ids; bad inputs get one line.

The checks that export and load a folder run twice (parameter ``hf``): with the installed (newest)
transformers in this process, and with the lowest supported one (the floor,
``torchscale_fairseq/interop/transformers-floor.txt``) in a worker process (``tests/helpers/hf_side.py``).
The fairseq side, the reference, always runs here."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="needs the export extra: pip install -e .[export]")
from fairseq.data import Dictionary  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402

from tests.helpers import hf_side  # noqa: E402
from tests.helpers.model_utils import FakeTask, dictionary  # noqa: E402
from tests.helpers.model_utils import args as model_args
from torchscale_fairseq.errors import TsConfigError  # noqa: E402
from torchscale_fairseq.interop.hf_export import export_hf  # noqa: E402
from torchscale_fairseq.models.lm import TsLanguageModel  # noqa: E402
from torchscale_fairseq.models.mlm import TsMaskedLMModel, ts_mlm_tiny  # noqa: E402
from torchscale_fairseq.models.transformer import TsTransformerModel, ts_transformer_tiny  # noqa: E402

# every backbone, dense and X-MoE; the options spread over them
CASES = {
    "magneto-dense": dict(backbone="magneto", activation_fn="swiglu", xpos=True, share_decoder_input_output_embed=False),
    "magneto-moe": dict(backbone="magneto", moe_expert_count=4, moe_freq=1, rel_pos_buckets=8),
    "deepnorm-dense": dict(backbone="deepnorm", decoder_learned_pos=True, rel_pos_buckets=8, decoder_layers=3),
    "deepnorm-moe": dict(backbone="deepnorm", moe_expert_count=4, moe_top_k=1, moe_router="linear",
                         moe_eval_capacity_factor=1.0, activation_fn="relu", share_decoder_input_output_embed=False),
    "preln-dense": dict(backbone="preln", decoder_learned_pos=True, activation_fn="relu", layernorm_embedding=True),
    "preln-moe": dict(backbone="preln", moe_expert_count=2, xpos=True, no_scale_embedding=True),
    "postln-dense": dict(backbone="postln", no_token_positional_embeddings=True, rel_pos_buckets=8),
    "postln-moe": dict(backbone="postln", moe_expert_count=4, moe_freq=2, decoder_learned_pos=True,
                       activation_fn="swiglu", moe_eval_capacity_factor=0.5),
    "magneto-fine-grained": dict(backbone="magneto", moe_expert_count=8, moe_freq=1, moe_top_k=4,
                                 moe_expert_ffn_dim=16, moe_shared_expert_count=2, moe_router_bias_update_rate=0.01),
}

# fairseq's adaptive input / adaptive softmax (vocabulary 48: bands cut at 20 and 40), tied or not;
# "tied-proj" is the demo's LM
ADAPTIVE = dict(share_decoder_input_output_embed=False, adaptive_softmax_cutoff="20,40")
ADAPTIVE_CASES = {
    "softmax-only": dict(ADAPTIVE, adaptive_softmax_factor=2, backbone="preln", decoder_learned_pos=True),
    "untied": dict(ADAPTIVE, adaptive_input=True, adaptive_input_cutoff="10,30", adaptive_input_factor=2,
                   adaptive_softmax_dropout=0.1),
    "tied": dict(ADAPTIVE, adaptive_input=True, tie_adaptive_weights=True, backbone="deepnorm"),
    "tied-proj": dict(ADAPTIVE, adaptive_input=True, adaptive_input_factor=2, adaptive_softmax_factor=2,
                      tie_adaptive_weights=True, tie_adaptive_proj=True, adaptive_softmax_dropout=0.1),
}


# the masked LM (ts_mlm_tiny's defaults: learned positions unless --no-token-positional-embeddings)
MLM_CASES = {
    "magneto-dense": dict(backbone="magneto", activation_fn="swiglu", xpos=True, encoder_learned_pos=False),
    "magneto-moe": dict(backbone="magneto", moe_expert_count=4, moe_freq=1, rel_pos_buckets=8),
    "deepnorm-dense": dict(backbone="deepnorm", rel_pos_buckets=8, encoder_layers=3),
    "deepnorm-moe": dict(backbone="deepnorm", moe_expert_count=4, moe_top_k=1, moe_router="linear",
                         moe_eval_capacity_factor=1.0, activation_fn="relu"),
    "preln-dense": dict(backbone="preln", no_scale_embedding=True, layernorm_embedding=True),
    "preln-moe": dict(backbone="preln", moe_expert_count=2, xpos=True, no_token_positional_embeddings=True),
    "postln-dense": dict(backbone="postln", encoder_learned_pos=False, rel_pos_buckets=8),
    "postln-moe": dict(backbone="postln", moe_expert_count=4, moe_freq=2, activation_fn="swiglu",
                       moe_eval_capacity_factor=0.5),
}

# the encoder-decoder (ts_transformer_tiny's sizes unless given; the encoder's width is the decoder's, which
# cross-attention reads); "separate": a source dictionary of its own (32 entries), the target's 48
MT_CASES = {
    "magneto-dense": dict(backbone="magneto", activation_fn="swiglu", xpos=True, share_all_embeddings=True),
    "magneto-moe": dict(backbone="magneto", moe_expert_count=4, moe_freq=1, rel_pos_buckets=8, separate=True,
                        share_decoder_input_output_embed=False),
    "deepnorm-dense": dict(backbone="deepnorm", encoder_learned_pos=True, decoder_learned_pos=True, rel_pos_buckets=8,
                           decoder_layers=3, separate=True),
    "deepnorm-moe": dict(backbone="deepnorm", moe_expert_count=4, moe_top_k=1, moe_router="linear",
                         moe_eval_capacity_factor=1.0, activation_fn="relu", share_decoder_input_output_embed=False),
    "preln-dense": dict(backbone="preln", layernorm_embedding=True, encoder_layers=3, encoder_ffn_embed_dim=96,
                        encoder_attention_heads=8, decoder_learned_pos=True),
    "preln-moe": dict(backbone="preln", moe_expert_count=2, xpos=True, no_scale_embedding=True,
                      share_all_embeddings=True),
    "postln-dense": dict(backbone="postln", no_token_positional_embeddings=True, rel_pos_buckets=8),
    "postln-moe": dict(backbone="postln", moe_expert_count=4, moe_freq=2, encoder_learned_pos=True,
                       activation_fn="swiglu", moe_eval_capacity_factor=0.5, share_all_embeddings=True),
    "preln-fine-grained": dict(backbone="preln", moe_expert_count=8, moe_freq=1, moe_top_k=3, moe_expert_ffn_dim=16,
                               moe_shared_expert_count=1, moe_router_bias_update_rate=0.01, moe_router="linear"),
}


class PairTask:
    """A translation task's two dictionaries."""

    def __init__(self, source: Dictionary, target: Dictionary) -> None:
        self.source_dictionary, self.target_dictionary = source, target


def build_lm(d: Dictionary, **overrides) -> tuple[TsLanguageModel, object]:
    return perturbed(TsLanguageModel, model_args(**overrides), FakeTask(d))


def build_mlm(d: Dictionary, **overrides) -> tuple[TsMaskedLMModel, object]:
    """A ``ts_mlm_tiny`` (its architecture's defaults filled in, as fairseq-train fills them)."""
    a = model_args(**overrides)
    ts_mlm_tiny(a)
    return perturbed(TsMaskedLMModel, a, FakeTask(d))


def build_mt(source: Dictionary, target: Dictionary, **overrides) -> tuple[TsTransformerModel, object]:
    """A ``ts_transformer_tiny`` translating ``source`` ids into ``target`` ids."""
    a = model_args(**overrides)
    ts_transformer_tiny(a)
    return perturbed(TsTransformerModel, a, PairTask(source, target))


def perturbed(cls, a, task):
    """``cls`` built from ``a`` for ``task`` (seed 0), in eval mode, and ``a``."""
    torch.manual_seed(0)
    model = cls.build_model(a, task)
    with torch.no_grad():  # non-trivial LayerNorm affines, so a swapped weight/bias shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("_layernorm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():  # auxiliary-loss-free balancing: biases that change choices
            if name.endswith(".expert_bias"):
                b.add_(0.1 * torch.randn_like(b))
    return model.eval(), a


def save_checkpoint(model: TsLanguageModel | TsMaskedLMModel | TsTransformerModel, a, path: Path,
                    data: Path | None = None, task: str | None = None, **task_options: Any) -> Path:
    """A checkpoint as fairseq-train writes it (``cfg.model`` with the architecture's name); ``task``
    defaults to ``masked_lm`` / ``language_modeling`` / ``translation``."""
    arch, default = {TsMaskedLMModel: ("ts_mlm_tiny", "masked_lm"), TsTransformerModel: ("ts_transformer_tiny", "translation"),
                     TsLanguageModel: ("ts_lm_tiny", "language_modeling")}[type(model)]
    task = task or default
    cfg = {"model": {**vars(a), "_name": arch}, "common": {"model_parallel_size": 1},
           "checkpoint": {"checkpoint_suffix": ""},
           "task": {"_name": task, "data": str(data) if data else None, **task_options}}
    torch.save({"cfg": cfg, "model": model.state_dict(), "extra_state": {}}, path)
    return path


def tokens_of(d: Dictionary, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(d.nspecial, len(d), (batch, length), generator=g)
    tokens[:, 0] = d.eos()
    return tokens


@pytest.fixture(scope="session")
def floor_worker(tmp_path_factory):
    """The floor-transformers worker, ended with the session."""
    worker = hf_side.FloorWorker(tmp_path_factory.mktemp("floor-worker"))
    yield worker
    worker.close()


@pytest.fixture(params=["installed", "floor"])
def hf(request):
    """The transformers half of a check (:mod:`tests.helpers.hf_side`'s functions), run with the
    installed transformers or with the floor one."""
    return hf_side if request.param == "installed" else request.getfixturevalue("floor_worker")


def test_declared_floor_is_the_tested_floor():
    """setup.py's export extra starts transformers at the release the floor checks run against."""
    setup_py = (hf_side.REPO_ROOT / "setup.py").read_text()
    declared = re.findall(r'"transformers>=([0-9][^",<]*)', setup_py)
    assert declared == [hf_side.floor_version()], f"setup.py declares transformers>={declared}"


def fairseq_search(model: TsLanguageModel, d: Dictionary, prefix: torch.Tensor, total: int,
                   beam: int) -> list[tuple[list[int], float]]:
    """The best hypothesis per row of ``prefix`` (its tokens after ``</s>``, up to and with the
    final ``</s>``, and its score) as fairseq-generate / fairseq-interactive search an LM: ``</s>``
    first, then the forced prefix, ``total`` tokens before a forced ``</s>``, length penalty 1."""
    gen = SequenceGenerator([model], d, beam_size=beam, max_len_b=total, min_len=1)
    src = prefix if prefix.size(1) else torch.full((prefix.size(0), 1), d.eos())
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((src.size(0),), src.size(1))}}
    hypos = gen.generate([model], sample, prefix_tokens=prefix if prefix.size(1) else None, bos_token=d.eos())
    return [(h[0]["tokens"].tolist(), h[0]["score"].item()) for h in hypos]


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_matches_fairseq(case, hf, tmp_path):
    d = dictionary()
    model, a = build_lm(d, **CASES[case])
    folder = str(tmp_path / "hf")
    hf.export(checkpoint=str(save_checkpoint(model, a, tmp_path / "checkpoint.pt")), out=folder)
    tokens = tokens_of(d, 3, 11, seed=1)
    with torch.no_grad():
        ref = model(tokens)[0]
    got = hf.forward(folder=folder, tokens=tokens)["logits"]
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4

    # with a capacity the routing depends on the batch: fairseq drops finished rows from it, and while
    # it forces a prefix its placeholder beams hold other tokens than generate()'s (one row, no prefix)
    capacity = CASES[case].get("moe_eval_capacity_factor", 0) > 0
    rows = 1 if capacity else 2
    assert_same_greedy(model, hf, folder, d, tokens[:rows, :5], total=12)
    assert_same_beam(model, hf, folder, d, tokens[:rows, 1:1 if capacity else 4], total=12)


def assert_same_greedy(model, hf, folder: str, d: Dictionary, prompt: torch.Tensor, total: int) -> None:
    """``generate()`` (KV cache) continues ``prompt`` (``</s>`` + prefix) as fairseq's greedy search."""
    expected = [tokens[:-1] for tokens, _ in fairseq_search(model, d, prompt[:, 1:], total, beam=1)]
    out = hf.greedy(folder=folder, prompt=prompt, max_new_tokens=total, pad=d.pad(), eos=d.eos())
    assert [row[1:1 + len(e)].tolist() for row, e in zip(out, expected)] == expected


def assert_same_beam(model, hf, folder: str, d: Dictionary, prefix: torch.Tensor, total: int) -> None:
    """``generate(num_beams=5)`` (KV cache reordered between steps) finds fairseq's best beam-5
    hypothesis after ``prefix``, with its score (length penalty 1)."""
    expected = fairseq_search(model, d, prefix, total, beam=5)
    got = hf.beam(folder=folder, prefix=prefix, total=total, beams=5, pad=d.pad(), eos=d.eos())
    assert got["tokens"] == [tokens for tokens, _ in expected]
    assert torch.allclose(got["scores"], torch.tensor([score for _, score in expected]), atol=1e-4)


@pytest.mark.parametrize("case", sorted(ADAPTIVE_CASES))
def test_adaptive_export_matches_fairseq(case, hf, tmp_path):
    """Adaptive input / softmax: the exported logits are fairseq's log-probabilities
    (``get_normalized_probs``) over the whole vocabulary, the loss is their mean NLL, greedy
    ``generate()`` is fairseq's greedy search; tied weights are written once."""
    d = dictionary()
    model, a = build_lm(d, **ADAPTIVE_CASES[case])
    folder = str(tmp_path / "hf")
    files = hf.export(checkpoint=str(save_checkpoint(model, a, tmp_path / "checkpoint.pt")), out=folder)
    tokens = tokens_of(d, 3, 11, seed=1)
    got = hf.forward(folder=folder, tokens=tokens, labels=tokens)
    with torch.no_grad():
        ref = model.get_normalized_probs(model(tokens), log_probs=True)
    assert got["logits"].shape == ref.shape == (3, 11, len(d))
    assert (got["logits"] - ref).abs().max().item() < 1e-4
    nll = -ref[:, :-1].gather(-1, tokens[:, 1:, None]).mean()
    assert abs(got["loss"].item() - nll.item()) < 1e-5
    assert_same_greedy(model, hf, folder, d, tokens[:2, :5], total=12)
    if case.startswith("tied"):
        from safetensors.torch import load_file

        names = load_file(str(Path(folder) / next(f for f in files if f.endswith(".safetensors")))).keys()
        assert "lm_head.head.class_proj.weight" in names and not any(".word_proj." in n for n in names)
        assert not any(re.fullmatch(r"lm_head\.tail\.\d+\.2\.weight", n) for n in names)
        assert any(re.fullmatch(r"lm_head\.tail\.\d+\.0\.weight", n) for n in names) == (case == "tied")


def test_padded_batch_and_loss(hf, tmp_path):
    """Left padding: each sequence's logits are those of the unpadded sequence (fairseq's
    positions skip pads); ``labels`` give fairseq's mean next-token cross-entropy."""
    d = dictionary()
    model, a = build_lm(d, backbone="magneto", moe_expert_count=4, moe_freq=1, decoder_learned_pos=True)
    folder = str(tmp_path / "hf")
    hf.export(checkpoint=str(save_checkpoint(model, a, tmp_path / "c.pt")), out=folder)
    tokens = tokens_of(d, 2, 9, seed=3)
    padded = tokens.clone()
    padded[1, :3] = d.pad()
    got = hf.forward(folder=folder, tokens=padded, attention_mask=padded.ne(d.pad()).long())["logits"][1, 3:]
    loss = hf.forward(folder=folder, tokens=tokens, labels=tokens)["loss"]
    with torch.no_grad():
        ref = model(tokens[1:, 3:])[0][0]
        lprobs = model.get_normalized_probs(model(tokens), log_probs=True)
    assert (got - ref).abs().max().item() < 1e-4
    nll = -lprobs[:, :-1].gather(-1, tokens[:, 1:, None]).mean()
    assert abs(loss.item() - nll.item()) < 1e-5


def test_sharded_safetensors(hf, tmp_path):
    d = dictionary()
    model, a = build_lm(d, backbone="preln")
    folder = str(tmp_path / "hf")
    files = hf.export(checkpoint=str(save_checkpoint(model, a, tmp_path / "c.pt")), out=folder, max_shard_size="50KB")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    tokens = tokens_of(d, 2, 7, seed=2)
    with torch.no_grad():
        ref = model(tokens)[0]
    assert (hf.forward(folder=folder, tokens=tokens)["logits"] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("tied", [True, False])
def test_native_gpt2(tied, hf, tmp_path):
    """A Pre-LN dense model with learned positions is a stock ``GPT2LMHeadModel``."""
    d = dictionary()
    extra = dict(no_scale_embedding=True) if tied else dict(share_decoder_input_output_embed=False)
    model, a = build_lm(d, backbone="preln", decoder_learned_pos=True, **extra)
    folder = str(tmp_path / "hf")
    hf.export(checkpoint=str(save_checkpoint(model, a, tmp_path / "c.pt")), out=folder, fmt="gpt2")
    tokens = tokens_of(d, 2, 10, seed=4)
    got = hf.forward(folder=folder, tokens=tokens)
    assert got["class"] == "GPT2LMHeadModel"
    with torch.no_grad():
        assert (got["logits"] - model(tokens)[0]).abs().max().item() < 1e-4
    assert_same_greedy(model, hf, folder, d, tokens[:2, :4], total=9)
    assert_same_beam(model, hf, folder, d, tokens[:2, 1:4], total=9)


@pytest.mark.parametrize("overrides, what", [
    (dict(backbone="magneto"), "--backbone magneto"),
    (dict(ADAPTIVE_CASES["softmax-only"], no_scale_embedding=True), "an adaptive input or adaptive softmax"),
], ids=["magneto", "adaptive"])
def test_gpt2_format_refuses_other_math(overrides, what, tmp_path):
    d = dictionary()
    model, a = build_lm(d, **overrides)
    with pytest.raises(TsConfigError, match=f"^--format gpt2 cannot express {what}"):
        export_hf(str(save_checkpoint(model, a, tmp_path / "c.pt")), str(tmp_path / "hf"), fmt="gpt2")
    assert not (tmp_path / "hf").exists()


def test_gpt2_tokenizer_gives_fairseq_ids(hf, tmp_path):
    """With the GPT-2 BPE dictionary the folder has a tokenizer whose ids are the fairseq ids
    (GPT-2 id + 4, ``</s>`` first), checked against tiktoken's GPT-2 encoding."""
    from data_prep.prepare_lm import write_gpt2_dict
    from torchscale_fairseq.data import gpt2_bpe

    write_gpt2_dict(tmp_path / "dict.txt", gpt2_bpe.N_VOCAB)
    d = Dictionary.load(str(tmp_path / "dict.txt"))
    model, a = build_lm(d, backbone="magneto", decoder_embed_dim=16, decoder_ffn_embed_dim=32, decoder_layers=1)
    folder = str(tmp_path / "hf")
    hf.export(checkpoint=str(save_checkpoint(model, a, tmp_path / "c.pt", data=tmp_path)), out=folder)
    text = "Hello world, it's 2026!\n  The café's naïve résumé\t— ok"
    [got] = hf.tokenize(folder=folder, texts=[text])
    assert got["ids"] == [d.eos()] + [i + 4 for i in gpt2_bpe.encode(text)]
    assert got["decoded"] == text


# unicode (NFKC-normalised by SentencePiece), extra and other whitespace, characters the model has never
# seen (its <unk>), the empty text, a leading "▁", and a word spelled without spaces
SPM_TEXTS = ["hello world, it's 2026!", "the café's naïve résumé, über straße, año.",
             "  The café's   naïve résumé — ok  ", "ｆｕｌｌｗｉｄｔｈ ﬁ ligature ①", "unknown: 漢字 ☃ and emoji 🙂🙂 end",
             "tab\there", "", "▁lead", "quickbrownfoxjumps"]


@pytest.fixture(scope="module")
def spm_data(tmp_path_factory) -> dict[str, Any]:
    """Data directories as data_prep writes them: ``lm``: the ``dict.txt`` and ``spm.model`` (unigram) of
    ``prepare_lm --spm-vocab``, ``lm-encode`` its encoding into pieces; ``mlm-unigram`` / ``mlm-bpe``:
    a ``train_spm`` model, no dictionary."""
    import random

    from data_prep.prepare_lm import sentencepiece_tokenizer
    from data_prep.train_spm import train_sentencepiece

    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog café naïve résumé año über straße world it's 2026".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + rng.choice(".!?,") for _ in range(300)]
    root = tmp_path_factory.mktemp("spm-data")
    dirs = {name: root / name for name in ("lm", "mlm-unigram", "mlm-bpe")}
    for folder in dirs.values():
        folder.mkdir()
    encode = sentencepiece_tokenizer(lines, 80, dirs["lm"] / "spm", dirs["lm"] / "dict.txt")
    (root / "train.txt").write_text("".join(line + "\n" for line in lines))
    for model_type in ("unigram", "bpe"):
        train_sentencepiece(root / "train.txt", dirs[f"mlm-{model_type}"] / "spm", 80, model_type)
    return {**dirs, "lm-encode": encode}


def assert_spm_tokenizer(hf, folder: str, model: Path, expected: list[list[int]]) -> None:
    """The folder's tokenizer gives ``expected`` for :data:`SPM_TEXTS` and decodes them back wherever
    SentencePiece itself does."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(model))
    got = hf.tokenize(folder=folder, texts=SPM_TEXTS)
    assert [g["ids"] for g in got] == expected
    round_trips = [(text, g) for text, g in zip(SPM_TEXTS, got) if processor.decode(processor.encode(text)) == text]
    assert len(round_trips) >= 4 and all(g["decoded"] == text for text, g in round_trips)


@pytest.mark.parametrize("kind", ["lm", "mlm"])
def test_spm_tokenizer_gives_fairseq_ids_prepare_lm(kind, hf, spm_data, tmp_path):
    """A ``ts_lm`` (``language_modeling``) or ``ts_mlm`` (``masked_lm``, which adds ``<mask>`` to the
    dictionary) trained on ``prepare_lm --spm-vocab`` data: ``spm.model`` found next to ``dict.txt``;
    the ids are the binarized ones (the pieces looked up in ``dict.txt`` as ``fairseq-preprocess``
    does), ``</s>`` first instead of last (LM) or after ``<s>`` (masked LM)."""
    data = spm_data["lm"]
    d = Dictionary.load(str(data / "dict.txt"))
    if kind == "lm":
        model, a = build_lm(d, decoder_embed_dim=16, decoder_ffn_embed_dim=32, decoder_layers=1)
    else:
        d.add_symbol("<mask>")
        model, a = build_mlm(d, encoder_layers=1)
    folder = str(tmp_path / "hf")
    assert "tokenizer.json" in hf.export(checkpoint=str(save_checkpoint(model, a, tmp_path / "c.pt", data=data)),
                                         out=folder)
    binarized = [d.encode_line(" ".join(pieces), add_if_not_exist=False).tolist()
                 for pieces in spm_data["lm-encode"](SPM_TEXTS)]
    expected = [[d.eos()] + ids[:-1] if kind == "lm" else [d.bos()] + ids for ids in binarized]
    assert_spm_tokenizer(hf, folder, data / "spm.model", expected)
    assert "the SentencePiece model of the training data" in (tmp_path / "hf" / "README.md").read_text()


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_spm_tokenizer_gives_fairseq_ids_mlm(model_type, hf, spm_data, tmp_path):
    """A ``ts_mlm`` trained with ``--task streaming_mlm`` on ``train_spm``'s model (no ``dict.txt``: the
    dictionary is derived from the model, as the task derives it): the ids are the task's
    (:class:`SentencePieceDocuments`), framed ``<s> text </s>``."""
    from torchscale_fairseq.data.document_encoders import (
        SentencePieceDocuments,
        load_sentencepiece,
        sentencepiece_dictionary,
    )

    spm_path = spm_data[f"mlm-{model_type}"] / "spm.model"
    d = sentencepiece_dictionary(load_sentencepiece(spm_path))
    model, a = build_mlm(d, encoder_layers=1)
    folder = str(tmp_path / "hf")
    hf.export(checkpoint=str(save_checkpoint(model, a, tmp_path / "c.pt", data=spm_path.parent, task="streaming_mlm")),
              out=folder)
    documents = SentencePieceDocuments(str(spm_path), d)
    assert_spm_tokenizer(hf, folder, spm_path, [[d.bos()] + documents([t])[:-1] for t in SPM_TEXTS])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["mask_token_id"] == d.index("<mask>")


@pytest.fixture(scope="module")
def nmt_data(tmp_path_factory) -> Path:
    """A ``prepare_nmt`` output directory; its valid and test lines have characters train never had."""
    from data_prep import prepare_nmt

    tmp = tmp_path_factory.mktemp("nmt")
    train = [t for t in SPM_TEXTS if t.strip()] * 4
    held_out = [f"Ωmega {i} ☃ — 漢字 ÉCOLE\tdone" for i in range(8)]
    for lang, flip in (("en", 1), ("es", -1)):
        (tmp / f"all.{lang}").write_text("".join(line[::flip] + "\n" for line in train + held_out))
    out = tmp / "out"
    prepare_nmt.main(["--out-dir", str(out), "--train-src", str(tmp / "all.en"), "--train-tgt", str(tmp / "all.es"),
                      "--valid-size", "4", "--test-size", "4", "--vocab-size", "60", "--workers", "1"])
    return out


def test_spm_tokenizer_gives_prepare_nmt_ids(hf, nmt_data, tmp_path):
    """``prepare_nmt``'s joined dictionary lists the pieces by frequency (not in SentencePiece's order)
    and pads itself with ``madeupword`` symbols: the tokenizer that ``ts-export-hf`` writes for a
    ``ts_transformer`` trained on it (its ``spm.model``) gives every raw line of every split and side the
    ids ``fairseq-preprocess`` binarized (``text </s>``, a translation source)."""
    from fairseq.data import data_utils

    from data_prep.prepare_nmt import SPLITS
    from torchscale_fairseq.data.document_encoders import load_sentencepiece

    d = Dictionary.load(str(nmt_data / "dict.en.txt"))
    processor = load_sentencepiece(nmt_data / "spm.model")
    assert d.symbols[-1].startswith("madeupword")
    assert any(d.index(processor.id_to_piece(i)) != i + 1 for i in range(3, processor.get_piece_size()))
    model, a = build_mt(d, d, share_all_embeddings=True, encoder_layers=1, decoder_layers=1)
    checkpoint = save_checkpoint(model, a, tmp_path / "c.pt", data=nmt_data, source_lang="en", target_lang="es")
    assert "tokenizer.json" in hf.export(checkpoint=str(checkpoint), out=str(tmp_path / "hf"))
    raw, binarized = [], []
    for split in SPLITS:
        for lang in ("en", "es"):
            raw += (nmt_data / "raw" / f"{split}.{lang}").read_text().splitlines()
            data = data_utils.load_indexed_dataset(str(nmt_data / f"{split}.en-es.{lang}"), d)
            binarized += [data[i].tolist() for i in range(len(data))]
    assert any(d.unk() in ids for ids in binarized)
    assert [g["ids"] for g in hf.tokenize(folder=str(tmp_path / "hf"), texts=raw)] == binarized


@pytest.mark.parametrize("no_repeat", [0, 2])
def test_hf_translate_is_fairseq_generate(no_repeat, nmt_data, tmp_path, capsys):
    """``python -m torchscale_fairseq.interop.hf_translate`` translates a ``prepare_nmt`` split with the
    exported model as ``fairseq-generate`` does (its batches, beam 5, ``--lenpen 0.6``, ``--max-len-a`` / ``--max-len-b``,
    ``--no-repeat-ngram-size``), in the output format ``data_prep.score_nmt`` reads, which scores it."""
    from data_prep import score_nmt
    from torchscale_fairseq.interop import hf_translate

    d = Dictionary.load(str(nmt_data / "dict.en.txt"))
    model, a = build_mt(d, d, share_all_embeddings=True, encoder_layers=1, decoder_layers=1)
    export_hf(str(save_checkpoint(model, a, tmp_path / "c.pt")), str(tmp_path / "hf"))
    hf_translate.main(["--folder", str(tmp_path / "hf"), "--data", str(nmt_data), "--subset", "valid",
                       "--max-len-a", "1.2", "--max-len-b", "3", "--max-tokens", "40", "--lenpen", "0.6",
                       "--no-repeat-ngram-size", str(no_repeat)])
    (tmp_path / "generate.txt").write_text(capsys.readouterr().out)
    got = score_nmt.read_hypotheses(tmp_path / "generate.txt")
    gen = SequenceGenerator([model], d, beam_size=5, max_len_a=1.2, max_len_b=3, len_penalty=0.6,
                            no_repeat_ngram_size=no_repeat)
    expected = {}
    for ids, source in hf_translate.batches(str(nmt_data), "valid", "en", "es", 40):
        sample = {"net_input": {"src_tokens": source, "src_lengths": source.ne(d.pad()).sum(1)}}
        for sent_id, hypos in zip(ids, gen.generate([model], sample)):
            expected[sent_id] = d.string(hypos[0]["tokens"]).split()
    assert len(got) == 4 and got == expected
    score_nmt.main(["--generate-output", str(tmp_path / "generate.txt"), "--spm-model", str(nmt_data / "spm.model"),
                    "--reference", str(nmt_data / "raw" / "valid.es")])
    assert capsys.readouterr().out.startswith("bleu ")


def test_hf_translate_raw_text_is_fairseq(nmt_data, tmp_path, capsys):
    """``hf_translate --text``: raw text through the exported tokenizer and model gives the text fairseq gives
    (SentencePiece pieces, ``Dictionary.encode_line``, ``SequenceGenerator`` with beam 4 and
    ``no_repeat_ngram_size`` 3 as the demo evaluates, pieces decoded by SentencePiece)."""
    import sentencepiece as spm

    d = Dictionary.load(str(nmt_data / "dict.en.txt"))
    model, a = build_mt(d, d, share_all_embeddings=True, encoder_layers=1, decoder_layers=1)
    checkpoint = save_checkpoint(model, a, tmp_path / "c.pt", data=nmt_data, source_lang="en", target_lang="es")
    export_hf(str(checkpoint), str(tmp_path / "hf"))
    texts = [line for line in (nmt_data / "raw" / "test.en").read_text().splitlines() if line.strip()][:3]
    from torchscale_fairseq.interop import hf_translate

    hf_translate.main(["--folder", str(tmp_path / "hf"), *(x for t in texts for x in ("--text", t)), "--beam", "4",
                       "--max-len-b", "6", "--no-repeat-ngram-size", "3"])
    got = capsys.readouterr().out.splitlines()
    processor = spm.SentencePieceProcessor(model_file=str(nmt_data / "spm.model"))
    gen = SequenceGenerator([model], d, beam_size=4, max_len_b=6, no_repeat_ngram_size=3)
    expected = []
    for text in texts:
        source = d.encode_line(" ".join(processor.encode(text, out_type=str)), add_if_not_exist=False).long()
        sample = {"net_input": {"src_tokens": source[None], "src_lengths": torch.tensor([len(source)])}}
        [hypos] = gen.generate([model], sample)
        expected.append(processor.decode(d.string(hypos[0]["tokens"]).split()))
    assert got == expected


def test_spm_tokenizer_bad_inputs_one_line(spm_data, tmp_path):
    """A missing, unreadable or foreign (dictionary symbols that are not its pieces) SentencePiece model is refused in
    one line, nothing written."""
    from data_prep.train_spm import train_sentencepiece

    d = Dictionary.load(str(spm_data["lm"] / "dict.txt"))
    model, a = build_lm(d, decoder_embed_dim=16, decoder_ffn_embed_dim=32, decoder_layers=1)
    ckpt = str(save_checkpoint(model, a, tmp_path / "c.pt", data=spm_data["lm"]))
    (tmp_path / "other.txt").write_text("".join(f"ZYX {i} QWERTY ÅÄÖ {i * 7}\n" for i in range(200)))
    train_sentencepiece(tmp_path / "other.txt", tmp_path / "other", 40)
    (tmp_path / "broken.model").write_bytes(b"not a model")
    cases = {str(tmp_path / "missing.model"): "^SentencePiece model .*missing.model does not exist: pass the .model",
             str(tmp_path / "broken.model"): "^SentencePiece model .*broken.model cannot be loaded",
             str(tmp_path / "other.model"): r"^\d+ symbols of the model's dictionary \(e.g. '.+'\) are not pieces of "
                                            r"SentencePiece model .*other.model: pass the SentencePiece model "
                                            r"the dictionary was built from \(--spm-model\)$"}
    for i, (path, message) in enumerate(cases.items()):
        with pytest.raises(TsConfigError, match=message) as info:
            export_hf(ckpt, str(tmp_path / f"o{i}"), spm_model=path)
        assert "\n" not in str(info.value) and not (tmp_path / f"o{i}").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_spm_pieces_missing_from_the_dictionary_become_unk(model_type, hf, spm_data, tmp_path):
    """``fairseq-preprocess`` leaves pieces the training data never used out of ``dict.txt``, and
    ``Dictionary.encode_line`` maps each to ``<unk>``: with a one-character and a longer piece of the
    texts taken out of the dictionary, the exported tokenizer (``TsTokenizerFast``, the model found next
    to ``dict.txt`` or passed as ``--spm-model``) still gives fairseq's ids, one ``<unk>`` per such piece."""
    import sentencepiece as spm

    spm_path = spm_data["lm"] / "spm.model" if model_type == "unigram" else spm_data["mlm-bpe"] / "spm.model"
    processor = spm.SentencePieceProcessor(model_file=str(spm_path))
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(spm_path, data / "spm.model")
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())
              if not (processor.is_control(i) or processor.is_unknown(i))]
    used = [p for text in SPM_TEXTS for p in processor.encode(text, out_type=str)]
    short = next(p for p in used if len(p) == 1 and p in pieces)
    long = next(p for p in used if len(p.lstrip("▁")) >= 3 and p in pieces)
    (data / "dict.txt").write_text("".join(f"{p} 1\n" for p in pieces if p not in (short, long)))
    d = Dictionary.load(str(data / "dict.txt"))
    model, a = build_lm(d, decoder_embed_dim=16, decoder_ffn_embed_dim=32, decoder_layers=1)
    ckpt = str(save_checkpoint(model, a, tmp_path / "c.pt", data=data))
    expected = [[d.eos()] + d.encode_line(" ".join(processor.encode(text, out_type=str)),
                                          add_if_not_exist=False).tolist()[:-1] for text in SPM_TEXTS]
    assert sum(ids.count(d.unk()) for ids in expected) >= 2
    for name, options in (("auto", {}), ("explicit", {"spm_model": str(data / "spm.model")})):
        written = export_hf(ckpt, str(tmp_path / name), **options)
        assert {"tokenizer.json", "tokenization_ts.py"} <= set(written)
        assert [g["ids"] for g in hf.tokenize(folder=str(tmp_path / name), texts=SPM_TEXTS)] == expected


def test_bad_inputs_one_line_nothing_overwritten(tmp_path):
    d = dictionary()
    model, a = build_lm(d, backbone="magneto", moe_expert_count=4, moe_freq=1)
    ckpt = save_checkpoint(model, a, tmp_path / "c.pt")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")

    def error(*args, **kwargs) -> str:
        with pytest.raises(TsConfigError) as info:
            export_hf(*args, **kwargs)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "already exists" in error(str(ckpt), str(existing))
    assert (existing / "keep.txt").read_text() == "mine" and len(list(existing.iterdir())) == 1
    # an unknown architecture
    state = torch.load(ckpt, weights_only=False)
    state["cfg"]["model"]["_name"] = "transformer_lm"
    torch.save(state, tmp_path / "other.pt")
    assert "is not a ts model" in error(str(tmp_path / "other.pt"), str(tmp_path / "o1"))
    # adaptive options that no ts_lm can have been trained with
    state = torch.load(ckpt, weights_only=False)
    state["cfg"]["model"].update(adaptive_softmax_cutoff="20,40", share_decoder_input_output_embed=False,
                                 tie_adaptive_proj=True)
    torch.save(state, tmp_path / "adaptive.pt")
    assert "--tie-adaptive-proj needs --tie-adaptive-weights" in error(str(tmp_path / "adaptive.pt"),
                                                                       str(tmp_path / "o6"))
    # a missing checkpoint / a missing expert shard / one expert shard passed alone
    assert "no checkpoint" in error(str(tmp_path / "missing.pt"), str(tmp_path / "o2"))
    state = torch.load(ckpt, weights_only=False)
    state["model"] = {k: v[:2] if ".experts." in k else v for k, v in state["model"].items()}
    state["cfg"]["distributed_training"] = {"distributed_rank": 0, "distributed_world_size": 2}
    torch.save(state, tmp_path / "moe-shard0.pt")
    assert "a part, stage or shard is missing" in error(str(tmp_path / "moe.pt"), str(tmp_path / "o3"))
    torch.save(state, tmp_path / "alone.pt")
    assert "is one of 1 tensor-parallel part(s) x 1 pipeline stage(s) x 2 expert shard(s)" in error(
        str(tmp_path / "alone.pt"), str(tmp_path / "o4"))
    assert "names one file of a sharded checkpoint" in error(str(tmp_path / "moe-shard0.pt"), str(tmp_path / "o5"))
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def write_parts_and_shards(model, a, tmp_path: Path) -> None:
    """``single.pt``, its 2 tensor-parallel parts ``tp-model_part-K.pt`` (split as ``ts-reshard`` splits
    them, vocabulary padded) and its 2 expert shards ``ep-shardR.pt`` (each rank 2 of the 4 experts)."""
    from torchscale_fairseq.checkpoints.convert import reshard_states
    from torchscale_fairseq.checkpoints.layout import RECORD_KEY as TP_STATE_KEY
    from torchscale_fairseq.model_parallel.partition import layout

    single = torch.load(save_checkpoint(model, a, tmp_path / "single.pt"), weights_only=False)
    single["extra_state"] = {TP_STATE_KEY: {"size": 1, "layout": layout(model), "params": None, "rng": {}}}
    for rank, part in enumerate(reshard_states([single], 2)):
        torch.save(part, tmp_path / f"tp-model_part-{rank}.pt")
    for rank in range(2):
        shard = {**single, "model": {k: v[2 * rank: 2 * rank + 2] if ".experts." in k else v
                                     for k, v in single["model"].items()}}
        shard["cfg"] = {**single["cfg"], "distributed_training": {"distributed_rank": rank,
                                                                  "distributed_world_size": 2}}
        torch.save(shard, tmp_path / f"ep-shard{rank}.pt")


def assert_parts_export_as_single(tmp_path: Path) -> None:
    """The parts and the shards of :func:`write_parts_and_shards` export to the single file's folder."""
    from safetensors.torch import load_file

    for name in ("single", "tp", "ep"):
        export_hf(str(tmp_path / f"{name}.pt"), str(tmp_path / f"hf-{name}"))
    expected = load_file(tmp_path / "hf-single" / "model.safetensors")
    for name in ("tp", "ep"):
        got = load_file(tmp_path / f"hf-{name}" / "model.safetensors")
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_tensor_parallel_parts_and_expert_shards(tmp_path):
    """A checkpoint saved as tensor-parallel parts (``-model_part-K``) or as expert shards
    (``-shardR``) exports to the same folder as the single file."""
    d = dictionary()
    model, a = build_lm(d, backbone="magneto", moe_expert_count=4, moe_freq=1, rel_pos_buckets=8,
                        share_decoder_input_output_embed=False)
    write_parts_and_shards(model, a, tmp_path)
    assert torch.load(tmp_path / "tp-model_part-0.pt", weights_only=False)["model"][
        "decoder.output_projection.weight"].size(0) == 128  # a slice of the padded vocabulary
    assert_parts_export_as_single(tmp_path)


@pytest.mark.parametrize("case", sorted(MLM_CASES))
def test_mlm_export_matches_fairseq(case, hf, tmp_path):
    """``AutoModelForMaskedLM``'s logits are the fairseq ``ts_mlm``'s, ``AutoModel``'s hidden states its
    encoder output, on a batch with a right-padded row (padding from ``attention_mask`` / the pad tokens)."""
    d = dictionary()
    model, a = build_mlm(d, **MLM_CASES[case])
    folder = str(tmp_path / "hf")
    files = hf.export(checkpoint=str(save_checkpoint(model, a, tmp_path / "checkpoint.pt")), out=folder)
    assert {"configuration_ts_mlm.py", "modeling_ts_mlm.py", "modeling_ts_lm.py"} <= set(files)
    tokens = tokens_of(d, 3, 11, seed=1)
    tokens[:, 0] = d.bos()
    tokens[1, 7:] = d.pad()
    with torch.no_grad():
        ref = model(tokens)[0]
        hidden = model(tokens, features_only=True)[0]
    got = hf.masked_lm(folder=folder, tokens=tokens, attention_mask=tokens.ne(d.pad()).long())
    assert got["classes"] == ["TsMLMForMaskedLM", "TsMLMModel"]
    assert got["logits"].shape == ref.shape == (3, 11, len(d)) and got["hidden"].shape == hidden.shape
    assert (got["logits"] - ref).abs().max().item() < 1e-4
    assert (got["hidden"] - hidden).abs().max().item() < 1e-4


def test_mlm_tensor_parallel_parts_and_expert_shards(tmp_path):
    """A ``ts_mlm`` saved as tensor-parallel parts or expert shards exports as the single file."""
    model, a = build_mlm(dictionary(), moe_expert_count=4, moe_freq=1, rel_pos_buckets=8)
    write_parts_and_shards(model, a, tmp_path)
    assert_parts_export_as_single(tmp_path)


def test_transformer_bad_inputs_one_line(tmp_path):
    """``--format gpt2`` and an expert-choice router are refused for a ``ts_transformer`` in one line,
    nothing written; a cache that is not an ``EncoderDecoderCache`` is refused in one line."""
    d = dictionary()
    folder = assert_export_refusals(lambda **options: build_mt(d, d, **options), "ts_transformer", tmp_path)
    from transformers import AutoModelForSeq2SeqLM, DynamicCache

    loaded = AutoModelForSeq2SeqLM.from_pretrained(str(folder), trust_remote_code=True)
    tokens = tokens_of(d, 2, 6, seed=5)
    with pytest.raises(TypeError, match="^the cache is a DynamicCache, not an EncoderDecoderCache: pass "):
        loaded(tokens, decoder_input_ids=tokens[:, :1], past_key_values=DynamicCache())


def assert_export_refusals(build, arch: str, tmp_path: Path) -> Path:
    """``--format gpt2`` and an expert-choice router are refused for the ``arch`` models ``build(**options)``
    makes in one line, nothing written; returns the folder a Pre-LN one is exported to."""
    model, a = build(backbone="preln")
    ckpt = save_checkpoint(model, a, tmp_path / "c.pt")
    with pytest.raises(TsConfigError, match=f"^--format gpt2 exports ts_lm language models only: export a {arch} "
                                            "with --format ts$"):
        export_hf(str(ckpt), str(tmp_path / "o1"), fmt="gpt2")
    routed, b = build(moe_expert_count=2, moe_router="expert_choice")
    with pytest.raises(TsConfigError, match="^--moe-router expert_choice routes over the whole batch"):
        export_hf(str(save_checkpoint(routed, b, tmp_path / "ec.pt")), str(tmp_path / "o2"))
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    export_hf(str(ckpt), str(tmp_path / "hf"))
    return tmp_path / "hf"


def test_mlm_bad_inputs_one_line(tmp_path):
    """``--format gpt2`` and an expert-choice router are refused for a ``ts_mlm`` in one line, nothing
    written; the exported model refuses an ``attention_mask`` of another shape in one line."""
    d = dictionary()
    folder = assert_export_refusals(lambda **options: build_mlm(d, **options), "ts_mlm", tmp_path)
    from transformers import AutoModelForMaskedLM

    loaded = AutoModelForMaskedLM.from_pretrained(str(folder), trust_remote_code=True)
    tokens = tokens_of(d, 2, 6, seed=5)
    with pytest.raises(ValueError, match=r"^attention_mask has shape \(2, 5\), input_ids \(2, 6\)$"):
        loaded(tokens, attention_mask=torch.ones(2, 5, dtype=torch.long))


def test_model_card_counts(tmp_path):
    """Every folder gets ``README.md`` whose dense and expert parameter counts are those of the loaded
    model (``AutoModelForCausalLM`` / ``AutoModelForMaskedLM`` / ``AutoModelForSeq2SeqLM``, tied weights
    once), naming the architecture, the backbone and the recorded options."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    d = dictionary()
    builds = {"lm": (build_lm(d, backbone="deepnorm", moe_expert_count=4, moe_freq=1), AutoModelForCausalLM),
              "mlm": (build_mlm(d, backbone="magneto", moe_expert_count=2, rel_pos_buckets=8), AutoModelForMaskedLM),
              "transformer": (build_mt(d, d, backbone="preln", moe_expert_count=2, share_all_embeddings=True),
                              AutoModelForSeq2SeqLM)}
    for kind, ((model, a), auto) in builds.items():
        folder = tmp_path / f"hf-{kind}"
        assert "README.md" in export_hf(str(save_checkpoint(model, a, tmp_path / f"{kind}.pt")), str(folder))
        card = (folder / "README.md").read_text()
        loaded = auto.from_pretrained(str(folder), trust_remote_code=True)
        expert = sum(p.numel() for name, p in loaded.named_parameters() if ".experts." in name)
        total = sum(p.numel() for p in loaded.parameters())
        counts = re.search(r"\*\*Parameters\.\*\* ([\d,]+) in all: ([\d,]+) dense, ([\d,]+) in experts", card)
        assert [int(c.replace(",", "")) for c in counts.groups()] == [total, total - expert, expert]
        assert expert > 0 and f"`ts_{kind}_tiny`" in card and f"backbone `{a.backbone}`" in card
        assert "moe_expert_count = " in card


def fairseq_translate(model: TsTransformerModel, d: Dictionary, source: torch.Tensor, total: int,
                      beam: int) -> list[tuple[list[int], float]]:
    """fairseq-generate's best hypothesis per row of ``source`` (left-padded, ending with ``</s>``): its
    tokens up to and with ``</s>``, and its score (beam ``beam``, length penalty 1, ``--max-len-b total``)."""
    gen = SequenceGenerator([model], d, beam_size=beam, max_len_b=total)
    sample = {"net_input": {"src_tokens": source, "src_lengths": source.ne(d.pad()).sum(1)}}
    return [(h[0]["tokens"].tolist(), h[0]["score"].item()) for h in gen.generate([model], sample)]


@pytest.mark.parametrize("case", sorted(MT_CASES))
def test_transformer_export_matches_fairseq(case, hf, tmp_path):
    """An exported ``ts_transformer`` (``AutoModelForSeq2SeqLM``) computes fairseq's teacher-forced logits
    (left-padded sources) and loss, its ``AutoModel`` the decoder's output, and ``generate()`` with the
    folder's generation config finds fairseq-generate's greedy and beam-5 translations and scores, for every
    backbone, dense and X-MoE, shared and separate embeddings."""
    options = dict(MT_CASES[case])
    target = dictionary()
    source = dictionary(24) if options.pop("separate", False) else target
    model, a = build_mt(source, target, **options)
    folder = str(tmp_path / "hf")
    files = hf.export(checkpoint=str(save_checkpoint(model, a, tmp_path / "checkpoint.pt")), out=folder)
    assert "generation_config.json" in files and "modeling_ts_transformer.py" in files
    src = tokens_of(source, 3, 9, seed=1).roll(-1, dims=1)  # ... </s>, as fairseq's translation sources
    src[1, :3] = source.pad()
    tgt = tokens_of(target, 3, 7, seed=2).roll(-1, dims=1)
    prev = tgt.roll(1, dims=1)  # </s> + target[:-1]: fairseq's prev_output_tokens
    got = hf.seq2seq(folder=folder, source=src, target=tgt)
    with torch.no_grad():
        ref = model(src, src.ne(source.pad()).sum(1), prev)[0]
        features = model.decoder(prev, model.encoder(src, src.ne(source.pad()).sum(1)), features_only=True)[0]
    assert got["class"] == "TsTransformerForConditionalGeneration" and got["logits"].shape == ref.shape
    assert (got["logits"] - ref).abs().max().item() < 1e-4
    assert (got["hidden"] - features).abs().max().item() < 1e-4
    nll = -torch.log_softmax(ref, dim=-1).gather(-1, tgt[..., None]).mean()
    assert abs(got["loss"].item() - nll.item()) < 1e-5
    assert got["generation"] == {"decoder_start_token_id": target.eos(), "num_beams": 5, "length_penalty": 1.0,
                                 "early_stopping": True, "min_new_tokens": 1, "suppress_tokens": [target.pad()]}

    # with a capacity the routing depends on the batch, from which fairseq drops finished rows: one row
    rows = src[:1] if options.get("moe_eval_capacity_factor", 0) > 0 else src
    for beam in (1, 5):
        expected = fairseq_translate(model, target, rows, total=10, beam=beam)
        out = hf.translate(folder=folder, source=rows, total=10, beams=beam)
        assert out["tokens"] == [tokens for tokens, _ in expected]
        if beam > 1:
            assert torch.allclose(out["scores"], torch.tensor([score for _, score in expected]), atol=1e-4)
