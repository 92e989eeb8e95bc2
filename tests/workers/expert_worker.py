"""One rank of the split-experts layer check (run by ``test_mp_experts.py``).

``python expert_worker.py RANK WORLD INIT_METHOD OUT``: WORLD = 4 ranks, tensor-parallel size 2
(TP groups {0, 1}, {2, 3}; data-parallel groups {0, 2}, {1, 3}), 4 experts spread over the
2 data-parallel ranks. Every MoE layer (split and replicated experts, two configurations) is
compared with the single-process layer built with the same seed, run on each data-parallel
rank's batch with the same seed for the routing draws: output, input gradient, balance
loss, router gradient, and each expert gradient (the sum over the data-parallel ranks'
batches of the reference gradients, this rank's experts and tensor-parallel shard), and the
expert part of the gradient norm; also the one-line errors of loading one mode's state into
the other and of an expert FFN width that 2 does not divide; and with activation dropout,
which generator each mode draws from. Every rank's maximum errors
(relative to ``max(1, |reference|)``), expert parameter counts and messages go to ``OUT``
(JSON, written by rank 0).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.rendezvous import leave_process_group
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import TP_STRIDE, is_expert, sharded_dim
from torchscale_fairseq.model_parallel.layers import ColumnParallelLinear
from torchscale_fairseq.model_parallel.parallel_context import (
    build_parallel_context,
    current_parallel_context,
    set_parallel_context,
)
from torchscale_fairseq.model_parallel.partition import layout, shard_tensor
from torchscale_fairseq.model_parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker, model_parallel_seed
from torchscale_fairseq.models.checkpoint_checks import check_state_dict_shapes
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.experts import GroupedExperts
from torchscale_fairseq.modules.moe.layer import MoELayer
from torchscale_fairseq.optim.grad_norm import squared_norm_parts

TP, EXPERTS, B, T, D, FFN = 2, 4, 3, 6, 8, 16
CONFIGS = {
    # Magneto: Sub-LN affine per expert, X-MoE router, the `random` second-expert draw
    "magneto": dict(cfg=MoEConfig(expert_count=EXPERTS, second_expert_policy="random"), activation="gelu",
                    subln=True),
    # fused SwiGLU fc1 (stride 2), noisy linear router, Gumbel `sampling`
    "swiglu": dict(cfg=MoEConfig(expert_count=EXPERTS, router="linear", gate_noise=0.5,
                                 second_expert_policy="sampling"), activation="swiglu", subln=False),
}


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` relative to ``max(1, max |b|)`` (X-MoE's temperature gradient sums every token)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0))


def build(spec: dict, parallel=None, tp_group=None) -> MoELayer:
    torch.manual_seed(5)
    return MoELayer(spec["cfg"], FFNSpec(D, FFN, spec["activation"], subln=spec["subln"]), parallel=parallel,
                    tp_group=tp_group)


def batch(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + dp_rank)
    x = torch.randn(B, T, D, generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[dp_rank, -2:] = True  # some padding
    return x, mask, torch.randn(B, T, D, generator=g)


def step(layer: MoELayer, dp_rank: int) -> dict:
    x, mask, grad_out = batch(dp_rank)
    x.requires_grad_()
    torch.manual_seed(300 + dp_rank)  # the routing draws: one seed per data-parallel rank
    layer.zero_grad()
    y, aux = layer(x, mask)
    ((y * grad_out).sum() + 0.5 * aux.balance_loss).backward()
    return {"out": y.detach(), "grad_x": x.grad, "loss": aux.balance_loss.detach(),
            "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}}


def reference(spec: dict) -> dict:
    """The single-process layer on each data-parallel rank's batch; expert gradients summed."""
    dense = build(spec)
    runs = [step(dense, r) for r in range(current_parallel_context().data_size)]
    expert_grads = {n: sum(run["grads"][n] for run in runs) for n, p in dense.named_parameters() if is_expert(p)}
    return {"runs": runs, "expert_grads": expert_grads, "params": dict(dense.named_parameters())}


def expected(p: torch.Tensor, full: torch.Tensor, first: int, local: int) -> torch.Tensor:
    """This rank's experts of a stacked expert tensor, and its tensor-parallel shard."""
    mine = full[first: first + local]
    dim = sharded_dim(p)
    if dim is None:
        return mine
    return shard_tensor(mine, dim, getattr(p, TP_STRIDE, 1), current_parallel_context().tensor_rank, TP)


def check(spec: dict, mode: str, ref: dict) -> dict:
    parallel = current_parallel_context().expert_parallel(EXPERTS)
    tp_group = current_parallel_context().tensor_group if mode == "split" else None
    layer = build(spec, parallel, tp_group)
    dp_rank = current_parallel_context().data_rank
    run = step(layer, dp_rank)
    mine = ref["runs"][dp_rank]
    errors = {"out": err(run["out"], mine["out"]), "grad_x": err(run["grad_x"], mine["grad_x"]),
              "balance_loss": err(run["loss"], mine["loss"])}
    first, local = parallel.first_expert, parallel.local_experts
    weights = grads = router = 0.0
    for name, p in layer.named_parameters():
        if is_expert(p):
            weights = max(weights, err(p.detach(), expected(p, ref["params"][name].detach(), first, local)))
            grads = max(grads, err(p.grad, expected(p, ref["expert_grads"][name], first, local)))
        else:
            router = max(router, err(p.grad, mine["grads"][name]))
    errors.update(expert_weights=weights, expert_grads=grads, router_grads=router)
    _, expert_sq = squared_norm_parts(layer.parameters(), current_parallel_context())
    reference_sq = sum(float(g.double().pow(2).sum()) for g in ref["expert_grads"].values())
    errors["expert_norm_rel"] = abs(float(expert_sq) - reference_sq) / reference_sq
    recorded = layout(layer)
    split_names = sorted(n for n, p in layer.named_parameters() if is_expert(p) and sharded_dim(p) is not None)
    return {"errors": errors, "expert_params": sum(p.numel() for p in layer.parameters() if is_expert(p)),
            "layout": {n: recorded[n]["dim"] for n in split_names}}


def mismatch_messages(spec: dict) -> dict[str, str]:
    """The one-line error of loading each mode's state into the other mode's model (a
    tensor-parallel model: the MoE layer beside a column-parallel layer)."""
    tp = current_parallel_context().tensor_group

    def model(mode: str) -> nn.Module:
        layer = build(spec, current_parallel_context().expert_parallel(EXPERTS), tp if mode == "split" else None)
        return nn.ModuleDict({"moe": layer, "attn": ColumnParallelLinear(D, D, tp_group=tp)})

    messages = {}
    for mode, other in (("split", "replicate"), ("replicate", "split")):
        try:
            check_state_dict_shapes(model(mode), model(other).state_dict())
            messages[mode] = ""
        except TsConfigError as e:
            messages[mode] = str(e)
    return messages


def dropout_streams() -> dict[str, dict[str, bool]]:
    """Activation dropout 0.3 in training: whether the default generator stays identical across
    the tensor-parallel group, the output is identical on its ranks, and the tracker's
    per-rank stream was drawn from (split: dropout on this rank's features; replicate: the
    default generator, as on every rank)."""
    tp = current_parallel_context().tensor_group
    out = {}
    for mode in ("split", "replicate"):
        torch.manual_seed(5)
        layer = MoELayer(CONFIGS["magneto"]["cfg"], FFNSpec(D, FFN, "gelu", 0.3, subln=True),
                         parallel=current_parallel_context().expert_parallel(EXPERTS), tp_group=tp if mode == "split" else None)
        x, mask, grad_out = batch(current_parallel_context().data_rank)
        torch.manual_seed(400)
        tracker_before = get_rng_tracker().state_dict()[MODEL_PARALLEL_RNG]["cpu"]
        y, aux = layer(x, mask)
        ((y * grad_out).sum() + aux.balance_loss).backward()
        tracker_used = not torch.equal(tracker_before, get_rng_tracker().state_dict()[MODEL_PARALLEL_RNG]["cpu"])
        mine = (torch.get_rng_state(), y.detach())
        everyone = [None] * dist.get_world_size(tp)
        dist.all_gather_object(everyone, mine, group=tp)
        out[mode] = {"default_rng_in_sync": all(torch.equal(s, mine[0]) for s, _ in everyone),
                     "same_output": all(torch.equal(o, mine[1]) for _, o in everyone),
                     "tracker_used": tracker_used}
    return out


def main() -> None:
    rank, world, init_method, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    set_parallel_context(build_parallel_context(TP))
    model_parallel_seed(9, current_parallel_context().tensor_rank, TP)
    results: dict = {}
    for name, spec in CONFIGS.items():
        ref = reference(spec)
        for mode in ("split", "replicate"):
            results[f"{name}/{mode}"] = check(spec, mode, ref)
    results["messages"] = mismatch_messages(CONFIGS["magneto"])
    results["dropout"] = dropout_streams()
    try:
        GroupedExperts(FFNSpec(D, FFN + 1), num_local=2, tp_group=current_parallel_context().tensor_group)
        results["odd_ffn"] = ""
    except TsConfigError as e:
        results["odd_ffn"] = str(e)
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ranks": everyone, "world": world, "tp": TP, "experts": EXPERTS, "dim": D, "ffn": FFN}, f,
                      indent=1)
    leave_process_group()


if __name__ == "__main__":
    main()
