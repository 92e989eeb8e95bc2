"""Why the X-MoE gate loss rises in the first updates: the router, or the tokens it routes?

    python experiments/early_routing.py /tmp/results-work/runs

Reads the checkpoints of ``bash experiments/run.sh routing_early`` (config ``xmoe`` seed 1 at
updates 1, 4, 8, 12, 16, 20; update 1 is the initial model: fairseq's polynomial schedule gives the
first update lr 0) and ``routing_xmoe_s1`` (update 200). On the first 16 validation blocks (2,048
tokens, eval mode) it captures every MoE layer's input and prints, per checkpoint: the balance loss
``E sum_e f_e p_e`` summed over the MoE layers (what ``moe_gate_loss`` logs; balanced = 2 here,
maximum 16), the load CV per layer (top-2 assignments), the mean routing entropy, the temperature,
and the anisotropy of the tokens as the router sees them (``|mean_t z_t|^2`` of the projected,
L2-normalised tokens ``z_t``: the mean pairwise cosine; 1 = all parallel); then the balance loss of
the router of update R applied to the layer inputs of update I, for every pair.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils

import torchscale_fairseq  # noqa: F401  (registers the plugin)
from torchscale_fairseq.modules.moe.layer import MoELayer


def main(runs: Path) -> None:
    paths = {1: runs / "routing_early_u1/checkpoint_last.pt"}
    paths |= {u: runs / f"routing_early_u20/checkpoint_1_{u}.pt" for u in (4, 8, 12, 16, 20)}
    paths[200] = runs / "routing_xmoe_s1/checkpoint_last.pt"
    models, task = {}, None
    for u, path in paths.items():
        ensemble, _, task = checkpoint_utils.load_model_ensemble_and_task([str(path)])
        models[u] = ensemble[0].eval()
    task.load_dataset("valid")
    src = torch.stack([task.dataset("valid")[i]["source"] for i in range(16)])

    def layer_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
        caught: list[torch.Tensor] = []
        hooks = [m.register_forward_pre_hook(lambda _m, args: caught.append(args[0].detach().flatten(0, -2)))
                 for m in model.modules() if isinstance(m, MoELayer)]
        with torch.no_grad():
            model(src)
        for h in hooks:
            h.remove()
        return caught

    def routing(router: torch.nn.Module, x: torch.Tensor) -> tuple[float, float, float, float]:
        with torch.no_grad():
            p = torch.softmax(router(x), -1)
            n = p.size(1)
            f = torch.bincount(p.argmax(1), minlength=n).float() / p.size(0)
            load = torch.bincount(p.topk(2, -1).indices.flatten(), minlength=n).float()
            z = F.normalize(F.linear(x.float(), router.proj.weight.float()), dim=-1)
            return (float(n * (f * p.mean(0)).sum()), float(load.std(unbiased=False) / load.mean()),
                    float(-(p * p.clamp(min=1e-12).log()).sum(1).mean()), float(z.mean(0).norm() ** 2))

    inputs = {u: layer_inputs(m) for u, m in models.items()}
    routers = {u: [m.router for m in model.modules() if isinstance(m, MoELayer)] for u, model in models.items()}
    print("update | balance loss (sum of layers) | load CV per layer | entropy (nats) | temperature | anisotropy per layer")
    for u in models:
        s = [routing(r, x) for r, x in zip(routers[u], inputs[u])]
        tau = [float(r.log_temperature.detach().exp()) for r in routers[u]]
        print(f"{u} | {sum(a[0] for a in s):.2f} | {' / '.join(f'{a[1]:.2f}' for a in s)} | "
              f"{sum(a[2] for a in s) / len(s):.2f} | {' / '.join(f'{t:.4f}' for t in tau)} | "
              f"{' / '.join(f'{a[3]:.2f}' for a in s)}")
    print("\nbalance loss (sum of layers): router of update R (rows) on the layer inputs of update I (columns)")
    print("R \\ I | " + " | ".join(str(u) for u in models))
    for ur in models:
        cells = [sum(routing(r, x)[0] for r, x in zip(routers[ur], inputs[ui])) for ui in models]
        print(f"{ur} | " + " | ".join(f"{c:.2f}" for c in cells))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/results-work/runs"))
