"""The MoE layers' auxiliary losses inside autograd (``MoEAuxLossAutoScaler``): with the scales of a
micro-batch set before its forward, the gradient of the base loss alone equals the gradient of
``base + w S sum_l L_l + w_z S sum_l Z_l`` written out on the layers' returned losses: eager, under
``--ts-compile`` and under ``--checkpoint-activations`` with another micro-batch's scale set
before the backward (the recomputation keeps the forward's, as 1F1B needs); scales of an ignored
batch are 0 and ``S`` sums over nothing without a group."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.model_utils import build, dictionary
from torchscale_fairseq.modules.moe.aux_loss import aux_loss_scales, set_aux_loss_scale
from torchscale_fairseq.modules.moe.layer import MoELayer

W, WZ, S = 0.1, 0.01, 16


def _grads(model, tokens, scale, later=None) -> torch.Tensor:
    """The gradient of the cross-entropy with ``scale`` set on the MoE layers (``None``: the terms
    written out in the loss); ``later``: set between the forward and the backward."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    set_aux_loss_scale(layers, scale)
    logits, extra = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    if scale is None:
        loss = loss + W * S * sum(a.balance_loss for a in extra["moe"]) + WZ * S * sum(a.z_loss for a in extra["moe"])
    if later is not None:
        set_aux_loss_scale(layers, later)
    model.zero_grad()
    loss.backward()
    set_aux_loss_scale(layers, None)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("flags", [{}, {"ts_compile": True}, {"checkpoint_activations": True}])
def test_autoscaled_gradients_equal_the_written_out_loss(flags, request):
    if flags.get("ts_compile"):
        request.getfixturevalue("aot_eager_layers")
    d = dictionary()
    torch.manual_seed(1)
    model = build("lm", d, decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=64, moe_expert_count=4,
                  moe_freq=1, **flags)
    model.train() if flags.get("checkpoint_activations") else model.eval()
    tokens = torch.randint(d.pad() + 1, len(d), (2, 9), generator=torch.Generator().manual_seed(0))
    (scale,) = aux_loss_scales([S], [False], W, WZ, 1.0, torch.device("cpu"))
    (other,) = aux_loss_scales([3 * S], [False], W, WZ, 1.0, torch.device("cpu"))
    torch.manual_seed(2)
    reference = _grads(model, tokens, None)
    torch.manual_seed(2)
    ours = _grads(model, tokens, scale, later=other)
    assert torch.allclose(ours, reference, rtol=1e-5, atol=1e-6)
    torch.manual_seed(2)
    assert not torch.allclose(_grads(model, tokens, other), reference, rtol=1e-5, atol=1e-6)


def test_scales_of_ignored_batches_are_zero():
    scales = aux_loss_scales([4, torch.tensor(6)], [False, True], 0.5, 0.25, 8.0, torch.device("cpu"))
    assert [float(s.balance) for s in scales] == [0.5 * 4 * 8.0, 0.0]
    assert [float(s.z) for s in scales] == [0.25 * 4 * 8.0, 0.0]
    assert [float(s.balance_sample_size) for s in scales] == [4.0, 6.0]
