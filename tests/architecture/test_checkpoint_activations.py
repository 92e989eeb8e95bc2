"""``--checkpoint-activations {none,full,selective}``.

- the flag: the bare flag means ``full`` (fairseq users' spelling), a bad mode is one line
  naming the valid ones, checkpoints from when it was a boolean still load;
- selective recomputation (Korthikanti et al. 2022, section 5: only softmax, attention
  dropout and scores x values are recomputed) gives the gradients of no recomputation, bit
  for bit (``torch.equal``: the recomputation replays the same kernel on the same inputs
  with the same generator state), dense and MoE, with dropout and attention dropout on;
- one layer's saved tensors drop by exactly the score tensors (formula from the shapes).
The tensor-parallel (2 gloo ranks) version of both checks is in
``tests/workers/layer_worker.py``."""

from __future__ import annotations

import pytest
import torch
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from tests.helpers.cli_utils import USER_DIR
from tests.helpers.model_utils import build, dictionary
from torchscale_fairseq.architecture.config import StackConfig, checkpoint_mode
from torchscale_fairseq.architecture.layer import TransformerLayer
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.backbone import build_backbone
from torchscale_fairseq.modules.multihead_attention import MultiheadAttention


def _parsed(*flags: str) -> str:
    argv = ["data-bin", "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_tiny", "--cpu", *flags]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    return checkpoint_mode(cfg.model.checkpoint_activations)


def test_flag_modes_and_the_bare_flag():
    assert _parsed() == "none"
    assert _parsed("--checkpoint-activations") == "full"
    assert _parsed("--checkpoint-activations", "--dropout", "0.1") == "full"
    assert _parsed("--checkpoint-activations", "full") == "full"
    assert _parsed("--checkpoint-activations", "selective") == "selective"


def test_bad_mode_is_one_line_naming_the_modes(capsys):
    with pytest.raises(SystemExit):
        _parsed("--checkpoint-activations", "nope")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--checkpoint-activations" in last and all(m in last for m in ("'none'", "'full'", "'selective'")), last
    # the same check where argparse is not involved (a config, --model-overrides, the API)
    with pytest.raises(TsConfigError, match="choose one of none, full, selective"):
        checkpoint_mode("nope")


def test_boolean_of_older_checkpoints_reads_as_a_mode():
    assert (checkpoint_mode(True), checkpoint_mode(False), checkpoint_mode(None)) == ("full", "none", "none")


def _lm_gradients(mode: str, dropout_seed: int = 5, **overrides):
    """Loss and parameter gradients of a tiny ``ts_lm`` (dropout and attention dropout on,
    padded rows so attention takes the explicit-mask path), the same seeds for every mode."""
    d = dictionary()
    torch.manual_seed(0)
    model = build("lm", d, dropout=0.1, attention_dropout=0.1, checkpoint_activations=mode, **overrides).train()
    attention = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
    assert attention and all(m.recompute_core == (mode == "selective") for m in attention)
    tokens = torch.randint(d.nspecial, len(d), (3, 12), generator=torch.Generator().manual_seed(1))
    tokens[0, -4:] = d.pad()
    torch.manual_seed(dropout_seed)
    out = model(tokens)[0]
    loss = out.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, out.detach()


@pytest.mark.parametrize("overrides", [{}, {"moe_expert_count": 4, "moe_freq": 1}, {"rel_pos_buckets": 8}],
                         ids=["dense", "moe", "rel-pos-bias"])
def test_selective_gradients_equal_no_recomputation(overrides):
    loss, grads, out = _lm_gradients("none", **overrides)
    s_loss, s_grads, s_out = _lm_gradients("selective", **overrides)
    assert torch.equal(loss, s_loss) and torch.equal(out, s_out)
    assert grads.keys() == s_grads.keys()
    for name, grad in grads.items():
        assert grad is not None and torch.equal(grad, s_grads[name]), name
    # the check has teeth: another dropout draw gives other gradients
    other = _lm_gradients("none", dropout_seed=6, **overrides)[1]
    assert any(not torch.equal(grads[n], other[n]) for n in grads)


def test_selective_encoder_decoder_gradients_equal_no_recomputation():
    """Encoder self-attention, decoder self- and cross-attention (padded source)."""
    d = dictionary()
    src = torch.randint(d.nspecial, len(d), (3, 9), generator=torch.Generator().manual_seed(2))
    src[0, :3] = d.pad()
    tgt = torch.randint(d.nspecial, len(d), (3, 7), generator=torch.Generator().manual_seed(3))
    grads = {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        model = build("mt", d, dropout=0.1, attention_dropout=0.1, checkpoint_activations=mode).train()
        torch.manual_seed(5)
        model(src, torch.full((3,), 9), tgt)[0].pow(2).mean().backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["none"].items():
        assert torch.equal(grad, grads["selective"][name]), name


B, T, D, HEADS = 2, 24, 16, 4


def _saved(selective: bool, attention_dropout: float, padded: bool) -> list[torch.Tensor]:
    """Every tensor one training layer's forward saves for backward."""
    cfg = StackConfig(embed_dim=D, ffn_dim=32, layers=2, attention_heads=HEADS,
                      backbone=build_backbone("magneto", "decoder_only", 0, 2), max_positions=64, dropout=0.1,
                      attention_dropout=attention_dropout, selective_recompute=selective)
    torch.manual_seed(0)
    layer = TransformerLayer(cfg).train()
    padding_mask = torch.zeros(B, T, dtype=torch.bool)
    padding_mask[0, -3:] = True
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(torch.randn(B, T, D, requires_grad=True), padding_mask=padding_mask if padded else None, causal=True)
    return saved


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("padded", [False, True], ids=["is-causal", "padding-mask"])
def test_selective_saves_no_attention_scores(padded):
    """With attention dropout SDPA's math kernel materialises the ``B*h*T*T`` scores and keeps
    three such tensors: the softmax output, the dropout mask, the dropped scores (the paper's
    ``5as/h`` bytes per ``sbh`` in 16-bit with a 1-byte mask; here fp32 and the CPU kernel keeps
    its mask in the activation dtype: ``(4 + 4 + 4) B h T^2`` bytes). Selective recomputation
    keeps none of them; it keeps ``q, k, v`` (as many bytes as the math kernel's own copies)
    and, where there is one, the ``(B, 1, T, T)`` boolean mask the recomputation needs."""
    none, selective = _saved(False, 0.1, padded), _saved(True, 0.1, padded)
    scores = B * HEADS * T * T
    assert sum(t.numel() == scores for t in none) == 3
    assert not any(t.numel() >= scores for t in selective)
    mask_bytes = B * T * T * 1 if padded else 0
    assert _nbytes(none) - _nbytes(selective) == (4 + 4 + 4) * scores - mask_bytes
    # tensors that hold memory (torch 2.11's checkpoint also saves an empty (0,) placeholder)
    assert sum(t.numel() > 0 for t in none) - sum(t.numel() > 0 for t in selective) == 3 - (1 if padded else 0)
    # selective keeps q, k, v as (B, h, T, d) views of the projection (the math kernel: copies)
    assert _nbytes([t for t in selective if t.shape == (B, HEADS, T, D // HEADS)]) == 3 * B * T * D * 4


def test_flash_kernel_never_saves_scores():
    """Without attention dropout (CPU flash kernel; CUDA flash / memory-efficient kernels
    likewise) no ``B*h*T*T`` tensor is saved with or without recomputation: selective then
    saves only the core's output and log-sum-exp, ``B h T (d + 1)`` floats."""
    none, selective = _saved(False, 0.0, False), _saved(True, 0.0, False)
    scores = B * HEADS * T * T
    assert not any(t.numel() >= scores for t in none + selective)
    assert _nbytes(none) - _nbytes(selective) == 4 * B * HEADS * T * (D // HEADS + 1)


@pytest.mark.parametrize("mode,flags", [("full", {}), ("selective", {"model_parallel_size": 2})])
def test_compile_with_a_stream_replay_is_one_line(mode, flags):
    """``torch.compile`` takes no custom ``context_fn`` in ``torch.utils.checkpoint``: full
    recomputation always passes the tensor-parallel stream replay, selective only under TP
    (without TP it passes none and compiles)."""
    with pytest.raises(TsConfigError, match=f"--ts-compile cannot compile .* --checkpoint-activations {mode}"):
        build("lm", ts_compile=True, checkpoint_activations=mode, **flags)
