"""Adam updates of one MoE layer, recorded, for tests that train a layer two ways and compare."""

from __future__ import annotations

from typing import Callable

import torch

from torchscale_fairseq.modules.moe.layer import MoELayer


def adam_steps(layer: MoELayer, x: torch.Tensor, padding: torch.Tensor, weight: torch.Tensor, steps: int = 2,
               after_step: Callable[[MoELayer], list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """``steps`` Adam updates (lr 1e-2) of ``layer`` on the loss ``sum(out * weight)`` + balance loss + z-loss,
    the random generator seeded ``10 + step`` before each forward (the same draws for both ways). Per step:
    the output, the two losses, the routing statistics, the input's and every parameter's gradient, then what
    ``after_step(layer)`` returns; at the end the parameters."""
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    seen = []
    for step in range(steps):
        tokens = x.clone().requires_grad_()
        torch.manual_seed(10 + step)
        out, aux = layer(tokens, padding)
        optimizer.zero_grad()
        ((out * weight).float().sum() + aux.balance_loss + aux.z_loss).backward()
        optimizer.step()
        stats = aux.stats
        seen += [out.detach(), aux.balance_loss.detach(), aux.z_loss.detach(), stats.tokens, stats.load_cv,
                 stats.dropped, stats.routed, stats.entropy_sum, tokens.grad]
        seen += [p.grad.clone() for p in layer.parameters()]
        seen += after_step(layer) if after_step is not None else []
    return seen + [p.detach().clone() for p in layer.parameters()]
