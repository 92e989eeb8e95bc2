"""``ts-import-torchscale``: a TorchScale 0.3.0 ``Decoder`` with random weights, saved, imported,
gives the same logits as ``ts_lm`` (loaded as ``fairseq-eval-lm`` loads it) and after
``ts-export-hf``; ``fairseq-train --restore-file`` takes the import.

TorchScale imports ``fairscale`` and ``timm`` at module level; where they are not installed the
tests put the two-function doubles of ``tests/doubles`` on the path while importing it."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="needs the export extra: pip install -e .[export]")
from fairseq import checkpoint_utils  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.modules import PositionalEmbedding  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from tests.helpers.cli_utils import USER_DIR, run_many, tool  # noqa: E402
from tests.helpers.model_utils import dictionary  # noqa: E402
from torchscale_fairseq.errors import TsConfigError  # noqa: E402
from torchscale_fairseq.interop.hf_export import export_hf  # noqa: E402
from torchscale_fairseq.interop.torchscale_import import import_torchscale  # noqa: E402

DOUBLES = str(Path(__file__).resolve().parents[1] / "doubles")


@pytest.fixture(scope="module")
def torchscale():
    """``(DecoderConfig, Decoder, EncoderDecoderConfig, EncoderDecoder)`` of the real torchscale package."""
    pytest.importorskip("torchscale", reason="pip install torchscale==0.3.0")
    missing = [m for m in ("fairscale", "timm") if importlib.util.find_spec(m) is None]
    if missing:
        sys.path.insert(0, DOUBLES)
    try:
        from torchscale.architecture.config import DecoderConfig, EncoderDecoderConfig
        from torchscale.architecture.decoder import Decoder
        from torchscale.architecture.encoder_decoder import EncoderDecoder
    finally:
        if missing:
            sys.path.remove(DOUBLES)
            for name in [n for n in sys.modules if n.split(".")[0] in missing]:
                del sys.modules[name]
    return DecoderConfig, Decoder, EncoderDecoderConfig, EncoderDecoder


# use_xmoe makes TorchScale's config pick the random second-expert policy, which samples in evaluation too
DETERMINISTIC_XMOE = dict(use_xmoe=True, moe_second_expert_policy="all")


def torchscale_config(config_class, **config):
    """``config_class(**config)``, then every field of ``config`` set again (TorchScale's config
    overrides some of them, e.g. the second-expert policy under ``use_xmoe``)."""
    cfg = config_class(**config)
    for name, value in config.items():
        setattr(cfg, name, value)
    cfg.dummy_a2a = True  # TorchScale's MoE all-to-all records CUDA events; one process exchanges nothing
    return cfg


def torchscale_decoder(torchscale, d: Dictionary, positions: str, **config):
    """A random TorchScale ``Decoder``; ``positions``: fairseq's ``learned`` or ``sinusoidal`` table, or ``none``."""
    DecoderConfig, Decoder, _, _ = torchscale
    cfg = torchscale_config(DecoderConfig, vocab_size=len(d), decoder_embed_dim=32, decoder_attention_heads=4,
                            decoder_ffn_embed_dim=64, decoder_layers=2, max_target_positions=64, **config)
    torch.manual_seed(0)
    embed = nn.Embedding(len(d), 32, padding_idx=d.pad())
    nn.init.normal_(embed.weight, std=32**-0.5)
    table = None if positions == "none" else PositionalEmbedding(64, 32, d.pad(), learned=positions == "learned")
    decoder = Decoder(cfg, embed_tokens=embed, embed_positions=table).eval()
    with torch.no_grad():  # non-trivial LayerNorm affines and biases
        for name, p in decoder.named_parameters():
            if "norm" in name or "_ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return decoder, cfg


def save_torchscale(decoder, cfg, path: Path) -> Path:
    torch.save({"model": decoder.state_dict(), "args": dict(vars(cfg))}, path)
    return path


def data_dir(d: Dictionary, path: Path) -> Path:
    path.mkdir()
    d.save(str(path / "dict.txt"))
    return path


CASES = {
    "magneto-xpos": dict(config=dict(subln=True, xpos_rel_pos=True), positions="none"),
    "magneto-learned-scaled": dict(config=dict(subln=True, no_scale_embedding=False), positions="learned"),
    "deepnorm-sinusoidal": dict(config=dict(deepnorm=True, share_decoder_input_output_embed=True,
                                            activation_fn="relu"), positions="sinusoidal"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_matches_torchscale(case, torchscale, tmp_path):
    spec = CASES[case]
    d = dictionary()
    decoder, cfg = torchscale_decoder(torchscale, d, spec["positions"], **spec["config"])
    tokens = torch.randint(d.nspecial, len(d), (2, 13), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = d.eos()
    with torch.no_grad():
        ref = decoder(tokens)[0]
    if spec["config"].get("deepnorm"):
        assert decoder.layers[0].alpha == pytest.approx(math.pow(4.0, 0.25))
    src = save_torchscale(decoder, cfg, tmp_path / "torchscale.pt")
    data = data_dir(d, tmp_path / "data")
    without_table = "none" if spec["positions"] == "learned" else spec["positions"]
    import_torchscale(str(src), str(tmp_path / "ts_lm.pt"), str(data), without_table)

    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "ts_lm.pt")])
    model = models[0].eval()
    with torch.no_grad():
        got = model(tokens)[0]
    assert (got - ref).abs().max().item() < 1e-4

    export_hf(str(tmp_path / "ts_lm.pt"), str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    with torch.no_grad():
        assert (hf(tokens).logits - ref).abs().max().item() < 1e-4


@pytest.fixture
def torchscale_moe(torchscale, tmp_path, monkeypatch):
    """TorchScale's MoE layers need a process group (here one gloo rank); its gate logs expert
    histograms with ``torch.histc`` on integer indices, which the CPU lacks (cast to float here)."""
    import torch.distributed as dist
    from torchscale.component.xmoe import global_groups

    from tests.helpers.rendezvous import leave_process_group, rendezvous_url

    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda x, *args, **kw: histc(x.float(), *args, **kw))
    dist.init_process_group("gloo", init_method=rendezvous_url(tmp_path), rank=0, world_size=1)
    yield torchscale
    for cached in (global_groups.get_moe_group, global_groups.get_all2all_group):
        cached.__dict__.clear()  # TorchScale caches its groups on the functions
    leave_process_group()


MOE_CASES = {  # no padding tokens (TorchScale routes them, ts_lm does not)
    "top2-subln-no-drop": dict(subln=True, moe_expert_count=4, moe_freq=2, moe_second_expert_policy="all",
                               moe_eval_capacity_token_fraction=1.0),
    "top2-drops": dict(subln=True, moe_expert_count=4, moe_freq=1, moe_second_expert_policy="all"),
    "top1-deepnorm": dict(deepnorm=True, moe_expert_count=2, moe_freq=1, moe_top1_expert=True),
    "xmoe-top2-subln": dict(subln=True, moe_expert_count=4, moe_freq=2, moe_eval_capacity_token_fraction=1.0,
                            **DETERMINISTIC_XMOE),
    "xmoe-top1-drops": dict(subln=True, moe_expert_count=4, moe_freq=1, moe_top1_expert=True, **DETERMINISTIC_XMOE),
}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_import_moe_matches_torchscale(case, torchscale_moe, tmp_path):
    """TorchScale's MoE decoder (linear gate or ``use_xmoe``'s, all experts in one state_dict) in
    evaluation, with and without dropped tokens (evaluation capacity ``ceil(fraction * T)``); an
    imported ``use_xmoe`` model also after ``ts-export-hf``."""
    d = dictionary()
    decoder, cfg = torchscale_decoder(torchscale_moe, d, "none", **MOE_CASES[case])
    tokens = torch.randint(d.nspecial, len(d), (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = decoder(tokens)[0]
    src = save_torchscale(decoder, cfg, tmp_path / "torchscale.pt")
    flags = import_torchscale(str(src), str(tmp_path / "ts_lm.pt"), str(data_dir(d, tmp_path / "data")))
    assert flags[flags.index("--moe-router") + 1] == ("torchscale_xmoe" if cfg.use_xmoe else "linear")
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "ts_lm.pt")])
    with torch.no_grad():
        got = models[0].eval()(tokens)[0]
    assert (got - ref).abs().max().item() < 1e-5
    if cfg.use_xmoe:
        export_hf(str(tmp_path / "ts_lm.pt"), str(tmp_path / "hf"))
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
        with torch.no_grad():
            assert (hf(tokens).logits - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("top1", [False, True], ids=["top2", "top1"])
def test_torchscale_xmoe_router_trains_as_torchscale_gate(top1, torchscale_moe):
    """In training, ``--moe-router torchscale_xmoe`` rescales its expert embeddings to norm 1.5 in
    place and scores ``(W x) . e / |e|`` as TorchScale's ``use_xmoe`` gate does: the same scores,
    embeddings and gradients from the same weights."""
    from torchscale.component.xmoe.routing import Top1Gate, Top2Gate

    from torchscale_fairseq.modules.moe.routers import build_router

    torch.manual_seed(3)
    gate = (Top1Gate(24, 6, use_xmoe=True) if top1 else Top2Gate(24, 6, use_xmoe=True)).train()
    ours = build_router("torchscale_xmoe", 24, 6, 16, 0.0).train()
    ours.load_state_dict({"proj.weight": gate.wg_reduction.weight.detach().clone(),
                          "expert_embeddings": gate.wg.detach().clone()})
    x = torch.randn(10, 24)
    captured = []
    gate._cosine = lambda mat1, mat2, cosine=gate._cosine: captured.append(cosine(mat1, mat2)) or captured[-1]
    gate(x)
    scores = ours(x)
    torch.testing.assert_close(scores, captured[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.expert_embeddings, gate.wg, rtol=1e-6, atol=1e-6)
    assert torch.allclose(ours.expert_embeddings.norm(dim=1), torch.full((6,), 1.5))
    weights = torch.randn(10, 6)
    (captured[0] * weights).sum().backward()
    (scores * weights).sum().backward()
    for mine, theirs in ((ours.proj.weight, gate.wg_reduction.weight), (ours.expert_embeddings, gate.wg)):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)


def test_import_moe_refusals(torchscale_moe, tmp_path):
    d = dictionary()
    data = data_dir(d, tmp_path / "data")
    decoder, cfg = torchscale_decoder(torchscale_moe, d, "none", moe_expert_count=4, moe_freq=2, moe_gating_use_fp32=False)
    with pytest.raises(TsConfigError, match="moe_gating_use_fp32 False"):
        import_torchscale(str(save_torchscale(decoder, cfg, tmp_path / "fp16.pt")), str(tmp_path / "a.pt"), str(data))
    decoder, cfg = torchscale_decoder(torchscale_moe, d, "none", moe_expert_count=4, moe_freq=2)
    state = {k: v for k, v in decoder.state_dict().items() if ".experts.3." not in k}
    torch.save({"model": state, "args": dict(vars(cfg))}, tmp_path / "shard.pt")
    with pytest.raises(TsConfigError, match=r"MoE layers \[.decoder.layers.1.\] hold \[3\] of 4 experts: one rank's"):
        import_torchscale(str(tmp_path / "shard.pt"), str(tmp_path / "b.pt"), str(data))
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists()


def torchscale_encoder_decoder(torchscale, d: Dictionary, learned: bool, **config):
    """A random TorchScale ``EncoderDecoder`` (both sides with fairseq's learned table, or none)."""
    _, _, EncoderDecoderConfig, EncoderDecoder = torchscale
    cfg = torchscale_config(EncoderDecoderConfig, vocab_size=len(d), encoder_embed_dim=32, encoder_attention_heads=4,
                            encoder_ffn_embed_dim=64, encoder_layers=2, decoder_embed_dim=32,
                            decoder_attention_heads=4, decoder_ffn_embed_dim=64, decoder_layers=2,
                            max_source_positions=64, max_target_positions=64, **config)
    torch.manual_seed(0)
    embeds = [nn.Embedding(len(d), 32, padding_idx=d.pad()) for _ in range(2)]
    tables = [PositionalEmbedding(64, 32, d.pad(), learned=True) if learned else None for _ in range(2)]
    model = EncoderDecoder(cfg, embeds[0], tables[0], None if cfg.share_all_embeddings else embeds[1], tables[1]).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "_ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model, cfg


ENCDEC_CASES = {
    "preln-learned": dict(config=dict(subln=False), learned=True),
    "deepnorm-shared": dict(config=dict(deepnorm=True, share_all_embeddings=True), learned=False),
    "deepnorm-shared-moe": dict(config=dict(deepnorm=True, share_all_embeddings=True, moe_expert_count=2, moe_freq=2,
                                            moe_second_expert_policy="all", moe_eval_capacity_token_fraction=1.0),
                                learned=False),
    "preln-xmoe": dict(config=dict(subln=False, moe_expert_count=4, moe_freq=2, moe_eval_capacity_token_fraction=1.0,
                                   **DETERMINISTIC_XMOE), learned=True),
}


@pytest.mark.parametrize("case", sorted(ENCDEC_CASES))
def test_import_encoder_decoder_matches_torchscale(case, torchscale_moe, tmp_path):
    """TorchScale's ``EncoderDecoder`` -> ``ts_transformer`` (source without padding: TorchScale's
    ``EncoderDecoder`` passes its encoder no padding mask; MoE without dropped tokens: TorchScale's
    encoder gives capacity slots in time-major order, ts_transformer's in batch-major order)."""
    spec, d = ENCDEC_CASES[case], dictionary()
    model, cfg = torchscale_encoder_decoder(torchscale_moe, d, spec["learned"], **spec["config"])
    src = torch.randint(d.nspecial, len(d), (2, 11), generator=torch.Generator().manual_seed(1))
    prev = torch.randint(d.nspecial, len(d), (2, 7), generator=torch.Generator().manual_seed(2))
    prev[:, 0] = d.eos()
    with torch.no_grad():
        ref = model(src, prev)[0]
    torch.save({"model": model.state_dict(), "args": dict(vars(cfg))}, tmp_path / "torchscale.pt")
    data = tmp_path / "data"
    data.mkdir()
    for lang in ("de", "en"):
        d.save(str(data / f"dict.{lang}.txt"))
    import_torchscale(str(tmp_path / "torchscale.pt"), str(tmp_path / "ts.pt"), str(data), langs=("de", "en"))
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "ts.pt")])
    with torch.no_grad():
        got = models[0].eval()(src, torch.full((2,), 11), prev)[0]
    assert (got - ref).abs().max().item() < 1e-5


def test_import_encoder_decoder_refusals(torchscale_moe, tmp_path):
    d = dictionary()
    model, cfg = torchscale_encoder_decoder(torchscale_moe, d, False)  # TorchScale's default: subln
    torch.save({"model": model.state_dict(), "args": dict(vars(cfg))}, tmp_path / "magneto.pt")
    with pytest.raises(TsConfigError, match="cross-attention has no Sub-LN"):
        import_torchscale(str(tmp_path / "magneto.pt"), str(tmp_path / "a.pt"), str(tmp_path), langs=("de", "en"))
    model, cfg = torchscale_encoder_decoder(torchscale_moe, d, False, deepnorm=True)
    torch.save({"model": model.state_dict(), "args": dict(vars(cfg))}, tmp_path / "deepnorm.pt")
    with pytest.raises(TsConfigError, match="needs --source-lang and --target-lang"):
        import_torchscale(str(tmp_path / "deepnorm.pt"), str(tmp_path / "a.pt"), str(tmp_path))
    assert not (tmp_path / "a.pt").exists()


@pytest.mark.parametrize("moe", [{}, DETERMINISTIC_XMOE], ids=["dense", "xmoe"])
def test_import_restores_in_fairseq_train(moe, torchscale_moe, lm_data, tmp_path):
    """``fairseq-train --restore-file`` continues from the import with the flags it returns
    (``fairseq-eval-lm`` loads models with ``load_model_ensemble_and_task``, tested above)."""
    d = Dictionary.load(str(lm_data / "dict.txt"))
    moe = dict(moe, moe_expert_count=2, moe_freq=2) if moe else {}
    decoder, cfg = torchscale_decoder(torchscale_moe, d, "learned", subln=True, **moe)
    src = save_torchscale(decoder, cfg, tmp_path / "torchscale.pt")
    ckpt = tmp_path / "ts_lm.pt"
    flags = import_torchscale(str(src), str(ckpt), str(lm_data))
    criterion = ["--criterion", "moe_cross_entropy"] if moe else []
    (trained,) = run_many([
        [tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--cpu", "--tokens-per-sample", "32",
         "--task", "language_modeling", "--arch", "ts_lm", *flags, *criterion,
         "--restore-file", ckpt, "--reset-optimizer", "--reset-dataloader", "--reset-meters",
         "--optimizer", "adam", "--lr", "1e-4", "--max-tokens", "256", "--max-update", "2",
         "--save-dir", tmp_path / "train", "--no-save", "--log-format", "simple", "--log-interval", "1"],
    ])
    log = trained.stderr + trained.stdout
    assert f"Loaded checkpoint {ckpt}" in log and "num_updates 2" in log.replace("num_updates=", "num_updates ")


def test_import_bad_inputs(torchscale, tmp_path):
    d = dictionary()
    data = data_dir(d, tmp_path / "data")
    decoder, cfg = torchscale_decoder(torchscale, d, "none", subln=True, rel_pos_buckets=8, max_rel_pos=32)
    src = save_torchscale(decoder, cfg, tmp_path / "relpos.pt")
    with pytest.raises(TsConfigError, match="bidirectional"):
        import_torchscale(str(src), str(tmp_path / "out.pt"), str(data))
    (tmp_path / "exists.pt").write_text("mine")
    with pytest.raises(TsConfigError, match="already exists"):
        import_torchscale(str(src), str(tmp_path / "exists.pt"), str(data))
    assert (tmp_path / "exists.pt").read_text() == "mine"
    small = data_dir(dictionary(10), tmp_path / "small")
    decoder, cfg = torchscale_decoder(torchscale, d, "none", subln=True)
    src = save_torchscale(decoder, cfg, tmp_path / "ok.pt")
    with pytest.raises(TsConfigError, match="entries but the decoder embedding"):
        import_torchscale(str(src), str(tmp_path / "out.pt"), str(small))
    assert not (tmp_path / "out.pt").exists()
