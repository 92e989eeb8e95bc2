"""One rank of the layer-level tensor-parallel checks (run by ``test_mp_layers.py``).

``python layer_worker.py RANK WORLD INIT_METHOD OUT [DEVICE]``: every parallel layer at N = WORLD is
compared, forward and backward, with its dense PyTorch counterpart built from the same
full weights (the N = 1 build with the same seed); rank 0 writes the maximum absolute
errors and the recorded collectives as JSON to ``OUT``. It also records every dropout
mask one training forward pass of a Magneto layer draws and whether each kind is the
same on all tensor-parallel ranks (Megatron-LM's RNG tracker semantics). ``DEVICE`` ``cuda`` builds every
tensor on the current GPU (collectives still over gloo, which takes CUDA tensors).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.collective_recorder import record_collectives
from tests.helpers.rendezvous import leave_process_group
from torchscale_fairseq.architecture.config import StackConfig
from torchscale_fairseq.architecture.layer import TransformerLayer
from torchscale_fairseq.model_parallel.attributes import TP_STRIDE, sharded_dim
from torchscale_fairseq.model_parallel.cross_entropy import (
    label_smoothed_loss,
    vocab_parallel_cross_entropy,
)
from torchscale_fairseq.model_parallel.grads import sum_sequence_parallel_grads
from torchscale_fairseq.model_parallel.layers import (
    ColumnParallelLinear,
    ParallelLayerNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
)
from torchscale_fairseq.model_parallel.linear_cross_entropy import linear_cross_entropy
from torchscale_fairseq.model_parallel.mappings import copy_to_tensor_parallel_region
from torchscale_fairseq.model_parallel.parallel_context import (
    ParallelContext,
    build_parallel_context,
    current_parallel_context,
    set_parallel_context,
)
from torchscale_fairseq.model_parallel.partition import shard_tensor
from torchscale_fairseq.model_parallel.random import get_rng_tracker, model_parallel_seed
from torchscale_fairseq.modules.backbone import build_backbone
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.layer import MoELayer

B, T, D, FFN, HEADS, V, PAD = 3, 5, 16, 32, 4, 300, 1
T_SP = 6  # a sequence divisible by the tensor-parallel sizes tested


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference of ``a`` from the reference ``b``, relative to ``b``'s largest
    magnitude when that exceeds 1 (float32 rounding grows with the values: a LayerNorm
    weight gradient summed over all tokens is O(10))."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max()) / max(1.0, float(b.float().abs().max()))


def tp():
    """The tensor-parallel group the parallel layers under test split over."""
    return current_parallel_context().tensor_group


def shard_of(full: torch.Tensor, dim: int, stride: int = 1) -> torch.Tensor:
    parallel = current_parallel_context()
    return shard_tensor(full, dim, stride, parallel.tensor_rank, parallel.tensor_size)


def seeded(seed: int, factory):
    torch.manual_seed(seed)
    return factory()


def randn(seed: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cpu").to(torch.get_default_device())


def param_grad_errors(parallel: nn.Module, dense_grads: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, p in parallel.named_parameters():
        dim = sharded_dim(p)
        full = dense_grads[name]
        expected = full if dim is None else shard_of(full, dim, getattr(p, TP_STRIDE, 1))
        worst = max(worst, err(p.grad, expected))
    return worst


def check_column(dense_cl: ColumnParallelLinear, world: int) -> dict[str, float]:
    ref = nn.Linear(16, 24)
    ref.weight.data.copy_(dense_cl.weight)
    ref.bias.data.copy_(dense_cl.bias)
    par = seeded(11, lambda: ColumnParallelLinear(16, 24, stride=3, tp_group=tp()))
    par.bias.data.copy_(shard_of(torch.arange(24.0) / 24, 0, 3))
    ref.bias.data.copy_(torch.arange(24.0) / 24)
    x_ref, x_par = randn(1, B, T, 16).requires_grad_(), randn(1, B, T, 16).requires_grad_()
    grad_out = randn(2, B, T, 24)
    y_ref = ref(x_ref)
    y_ref.backward(grad_out)
    y_par = par(x_par)
    y_par.backward(shard_of(grad_out, 2, 3))
    gathering = seeded(11, lambda: ColumnParallelLinear(16, 24, stride=3, gather_output=True, tp_group=tp()))
    gathering.bias.data.copy_(par.bias)
    x_g = randn(1, B, T, 16).requires_grad_()
    y_g = gathering(x_g)
    y_g.backward(grad_out)
    return {
        "weight": err(par.weight, shard_of(dense_cl.weight, 0, 3)),
        "out": err(y_par, shard_of(y_ref.detach(), 2, 3)),
        "gathered_out": err(y_g, y_ref),
        "gathered_grad_x": err(x_g.grad, x_ref.grad),
        "grad_x": err(x_par.grad, x_ref.grad),
        "grad_params": param_grad_errors(par, {"weight": ref.weight.grad, "bias": ref.bias.grad}),
    }


def check_row(dense_rl: RowParallelLinear) -> dict[str, float]:
    ref = nn.Linear(24, 16)
    ref.weight.data.copy_(dense_rl.weight)
    ref.bias.data.copy_(torch.linspace(-1, 1, 16))
    par = seeded(12, lambda: RowParallelLinear(24, 16, tp_group=tp()))
    par.bias.data.copy_(torch.linspace(-1, 1, 16))
    x_full = randn(3, B, T, 24)
    x_ref, x_par = x_full.clone().requires_grad_(), shard_of(x_full, 2).requires_grad_()
    grad_out = randn(4, B, T, 16)
    y_ref = ref(x_ref)
    y_ref.backward(grad_out)
    y_par = par(x_par)
    y_par.backward(grad_out)
    return {
        "out": err(y_par, y_ref),
        "grad_x": err(x_par.grad, shard_of(x_ref.grad, 2)),
        "grad_params": param_grad_errors(par, {"weight": ref.weight.grad, "bias": ref.bias.grad}),
    }


def check_embedding(dense_emb: VocabParallelEmbedding, world: int) -> dict[str, float]:
    ref = nn.Embedding(V, D, padding_idx=PAD)
    ref.weight.data.copy_(dense_emb.weight)
    par = seeded(13, lambda: VocabParallelEmbedding(V, D, padding_idx=PAD, tp_group=tp()))
    tokens = torch.tensor([[0, 1, 5, 299, 200], [150, 1, 1, 7, 298], [3, 100, 250, 2, 1]])
    grad_out = randn(5, B, T, D)
    ref(tokens).backward(grad_out)
    y_par = par(tokens)
    y_par.backward(grad_out)
    padded = padded_vocab_size(V, world)
    full_grad = torch.cat([ref.weight.grad, torch.zeros(padded - V, D)])
    full_weight = torch.cat([ref.weight.detach(), torch.zeros(padded - V, D)])
    return {
        "weight": err(par.weight, shard_of(full_weight, 0)),
        "out": err(y_par, ref(tokens)),
        "grad_params": err(par.weight.grad, shard_of(full_grad, 0)),
    }


def check_layernorm() -> dict[str, float]:
    ref = nn.LayerNorm(24)
    ref.weight.data.copy_(randn(6, 24))
    ref.bias.data.copy_(randn(7, 24))
    par = ParallelLayerNorm(24, tp_group=tp())
    par.weight.data.copy_(shard_of(ref.weight.detach(), 0))
    par.bias.data.copy_(shard_of(ref.bias.detach(), 0))
    x_full = randn(8, B, T, 24) * 3 + 1
    x_ref, x_par = x_full.clone().requires_grad_(), shard_of(x_full, 2).requires_grad_()
    grad_out = randn(9, B, T, 24)
    y_ref = ref(x_ref)
    y_ref.backward(grad_out)
    y_par = par(x_par)
    y_par.backward(shard_of(grad_out, 2))
    return {
        "out": err(y_par, shard_of(y_ref.detach(), 2)),
        "grad_x": err(x_par.grad, shard_of(x_ref.grad, 2)),
        "grad_params": param_grad_errors(par, {"weight": ref.weight.grad, "bias": ref.bias.grad}),
    }


def check_cross_entropy(world: int) -> tuple[dict[str, float], list]:
    eps = 0.1
    logits_full = randn(10, B * T, V) * 4
    target = torch.tensor([0, 5, PAD, 299, 150, 151, 2, 7, PAD, 255, 128, 127, 3, 42, 200])
    ref_logits = logits_full.clone().requires_grad_()
    lprobs = F.log_softmax(ref_logits, dim=-1)
    ref_loss, ref_nll = label_smoothed_nll_loss(lprobs, target.unsqueeze(-1), eps, ignore_index=PAD)
    ref_loss.backward()
    padded = padded_vocab_size(V, world)
    garbage = torch.full((B * T, padded - V), 50.0)
    par_logits = shard_of(torch.cat([logits_full, garbage], dim=1), 1).requires_grad_()
    with record_collectives() as log:
        losses = vocab_parallel_cross_entropy(par_logits, target, V, tp())
    loss, nll = label_smoothed_loss(losses, target, eps, V, PAD)
    loss.backward()
    full_grad = torch.cat([ref_logits.grad, torch.zeros(B * T, padded - V)], dim=1)
    argmax_ok = losses.target_is_max.eq(logits_full.argmax(-1).eq(target))
    plain = F.cross_entropy(logits_full, target, ignore_index=PAD, reduction="sum")
    plain_par = losses.nll.masked_fill(target.eq(PAD), 0).sum()
    return {
        "loss": err(loss, ref_loss),
        "nll": err(nll, ref_nll),
        "plain_nll": err(plain_par, plain),
        "grad_logits": err(par_logits.grad, shard_of(full_grad, 1)),
        "argmax_mismatches": float((~argmax_ok).sum()),
    }, list(log)


def check_linear_cross_entropy(world: int) -> tuple[dict[str, float], list]:
    """The fused output layer + cross-entropy on this rank's vocabulary rows (padding rows set to
    large values, which must not count) against the dense output layer and ``F.cross_entropy``."""
    hidden_full, weight_full = randn(20, B * T, D), randn(21, V, D)
    target = torch.tensor([0, 5, PAD, 299, 150, 151, 2, 7, PAD, 255, 128, 127, 3, 42, 200])
    ref_h, ref_w = hidden_full.clone().requires_grad_(), weight_full.clone().requires_grad_()
    ref = F.cross_entropy(ref_h @ ref_w.t(), target, ignore_index=PAD, reduction="sum")
    ref.backward()
    padded = padded_vocab_size(V, world)
    garbage = torch.full((padded - V, D), 3.0)
    weight = shard_of(torch.cat([weight_full, garbage]), 0).requires_grad_()
    hidden = hidden_full.clone().requires_grad_()
    with record_collectives() as log:
        loss = linear_cross_entropy(copy_to_tensor_parallel_region(hidden, tp()), weight, target, V, PAD, chunk=4,
                                    group=tp())
        loss.backward()
    full_weight_grad = torch.cat([ref_w.grad, torch.zeros(padded - V, D)])
    return {
        "loss": err(loss, ref),
        "grad_hidden": err(hidden.grad, ref_h.grad),
        "grad_weight": err(weight.grad, shard_of(full_weight_grad, 0)),
    }, list(log)


def layer_config(backbone: str, parallel: ParallelContext | None = None, sequence_parallel: bool = False) -> StackConfig:
    return StackConfig(
        embed_dim=D, ffn_dim=FFN, layers=2, attention_heads=HEADS,
        backbone=build_backbone(backbone, "decoder_only", 0, 2), max_positions=64, dropout=0.0,
        parallel=parallel or ParallelContext.single_process(), sequence_parallel=sequence_parallel,
    )


def dense_transformer_layer(backbone: str, t: int = T) -> dict:
    """Output and gradients of the unsharded layer (call before the groups exist)."""
    dense = seeded(20, lambda: TransformerLayer(layer_config(backbone)))
    x = randn(21, B, t, D).requires_grad_()
    y, _ = dense(x, causal=True)
    y.backward(randn(22, B, t, D))
    return {"out": y.detach(), "grad_x": x.grad, "grads": {n: p.grad for n, p in dense.named_parameters()}}


def check_sequence_parallel_layer(backbone: str, dense: dict) -> tuple[dict[str, float], list]:
    """The layer on this rank's slice of a T_SP-long sequence (sequence parallelism):
    output and input gradient equal the dense layer's on those positions, and the
    parameter gradients once the sequence-parallel ones are summed over the group."""
    par = seeded(20, lambda: TransformerLayer(layer_config(backbone, current_parallel_context(), sequence_parallel=True)))
    x = sequence_slice(randn(21, B, T_SP, D)).requires_grad_()
    with record_collectives() as log:
        y, _ = par(x, causal=True)
        y.backward(sequence_slice(randn(22, B, T_SP, D)))
    sum_sequence_parallel_grads(par, tp())
    return {
        "out": err(y, sequence_slice(dense["out"])),
        "grad_x": err(x.grad, sequence_slice(dense["grad_x"])),
        "grad_params": param_grad_errors(par, dense["grads"]),
    }, list(log)


def moe_transformer_layer(parallel: ParallelContext | None = None, sequence_parallel: bool = False) -> TransformerLayer:
    """A Magneto layer whose FFN is an X-MoE layer (4 split experts, both experts of every token)."""
    cfg = layer_config("magneto", parallel, sequence_parallel)
    tp_group = cfg.tp_group
    b = cfg.backbone
    moe = MoELayer(MoEConfig(expert_count=4, second_expert_policy="all"), FFNSpec(D, FFN, cfg.activation, 0.0, b.subln, b.gain,
                   cfg.layernorm_eps), tag="moe", tp_group=tp_group,
                   sequence_group=tp_group if sequence_parallel else None)
    return TransformerLayer(cfg, ffn=moe)


def moe_padding_mask() -> torch.Tensor:
    """The full-length mask both runs get: the last two positions of the first sequence are padding."""
    mask = torch.zeros(B, T_SP, dtype=torch.bool)
    mask[0, -2:] = True
    return mask


def dense_moe_layer() -> dict:
    """Output, balance loss and gradients of the unsplit MoE layer on the whole sequence."""
    dense = seeded(23, moe_transformer_layer)
    x = randn(21, B, T_SP, D).requires_grad_()
    y, aux = dense(x, padding_mask=moe_padding_mask(), causal=True)
    torch.autograd.backward([y, aux.balance_loss], [randn(22, B, T_SP, D), torch.ones(())])
    return {"out": y.detach(), "loss": aux.balance_loss.detach(), "grad_x": x.grad,
            "grads": {n: p.grad for n, p in dense.named_parameters()}}


def check_sequence_parallel_moe_layer(dense: dict) -> tuple[dict[str, float], list]:
    """The MoE layer on this rank's slice with the full-length padding mask: output and
    input gradient equal the unsplit layer's on those positions, the balance loss equals
    its loss (routing over the same tokens), and the parameter gradients (router and
    split experts unmarked, LayerNorms summed over the group) equal its gradients."""
    par = seeded(23, lambda: moe_transformer_layer(current_parallel_context(), sequence_parallel=True))
    x = sequence_slice(randn(21, B, T_SP, D)).requires_grad_()
    with record_collectives() as log:
        y, aux = par(x, padding_mask=moe_padding_mask(), causal=True)
        torch.autograd.backward([y, aux.balance_loss], [sequence_slice(randn(22, B, T_SP, D)), torch.ones(())])
    sum_sequence_parallel_grads(par, tp())
    return {
        "out": err(y, sequence_slice(dense["out"])),
        "loss": err(aux.balance_loss, dense["loss"]),
        "grad_x": err(x.grad, sequence_slice(dense["grad_x"])),
        "grad_params": param_grad_errors(par, dense["grads"]),
    }, list(log)


def sequence_slice(full: torch.Tensor) -> torch.Tensor:
    parallel = current_parallel_context()
    return full.chunk(parallel.tensor_size, dim=1)[parallel.tensor_rank].clone()


def check_transformer_layer(backbone: str, dense: dict) -> tuple[dict[str, float], list]:
    par = seeded(20, lambda: TransformerLayer(layer_config(backbone, current_parallel_context())))
    x = randn(21, B, T, D).requires_grad_()
    with record_collectives() as log:
        y, _ = par(x, causal=True)
        y.backward(randn(22, B, T, D))
    return {
        "out": err(y, dense["out"]),
        "grad_x": err(x.grad, dense["grad_x"]),
        "grad_params": param_grad_errors(par, dense["grads"]),
    }, list(log)


class DropoutMasks(TorchDispatchMode):
    """Records, in call order, every tensor ``bernoulli_`` fills: the dropout masks (``F.dropout``,
    the fused residual ``dropout_add`` and SDPA's attention dropout all draw through it on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.masks.append(out.detach().clone())
        return out


def same_on_all_ranks(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp()))]
    dist.all_gather(parts, t.contiguous(), group=tp())
    return all(torch.equal(p, parts[0]) for p in parts)


def check_dropout_masks(world: int, seed: int = 5) -> dict[str, dict]:
    """One training forward pass of a Magneto layer with residual, attention and activation
    dropout 0.1, the same input and default-generator seed on every rank (as fairseq seeds
    each update): per kind of mask (told apart by shape), how many were drawn and whether
    each is identical on all tensor-parallel ranks. ``tracked``: the per-rank stream seeded
    as ``--model-parallel-size`` seeds it; ``untracked``: the tracker reset (the control:
    every mask comes from the default generator)."""
    heads, ffn = HEADS // world, 48 // world
    kinds = {(B, heads, T, T): "attention", (B, T, ffn): "activation", (B, T, D): "residual"}
    cfg = StackConfig(
        embed_dim=D, ffn_dim=48, layers=2, attention_heads=HEADS, backbone=build_backbone("magneto", "decoder_only", 0, 2),
        max_positions=64, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, parallel=current_parallel_context(),
    )
    layer = seeded(30, lambda: TransformerLayer(cfg)).train()
    x = randn(31, B, T, D)
    out: dict[str, dict] = {}
    for case in ("tracked", "untracked"):
        model_parallel_seed(seed, current_parallel_context().tensor_rank, world)
        if case == "untracked":
            get_rng_tracker().reset()
        torch.manual_seed(seed)
        with DropoutMasks() as recorder:
            layer(x, causal=True)
        found: dict[str, dict] = {}
        for mask in recorder.masks:
            entry = found.setdefault(kinds.get(tuple(mask.shape), str(tuple(mask.shape))), {"count": 0, "same": []})
            entry["count"] += 1
            entry["same"].append(same_on_all_ranks(mask))
        found["default_generator_after"] = {"count": 1, "same": [same_on_all_ranks(torch.rand(8))]}
        out[case] = found
    get_rng_tracker().reset()
    return out


def _recompute_run(selective: bool, streams: dict, sequence_parallel: bool) -> tuple:
    """One forward and backward of the parallel layer from the tracker ``streams`` and seed 32
    (with sequence parallelism on this rank's slice of a ``T_SP``-long sequence)."""
    get_rng_tracker().load_state_dict(streams)
    cfg = StackConfig(embed_dim=D, ffn_dim=FFN, layers=2, attention_heads=HEADS,
                      backbone=build_backbone("magneto", "decoder_only", 0, 2), max_positions=64, dropout=0.1,
                      attention_dropout=0.3, selective_recompute=selective, parallel=current_parallel_context(),
                      sequence_parallel=sequence_parallel)
    layer = seeded(30, lambda: TransformerLayer(cfg))
    t = T_SP if sequence_parallel else T
    x = randn(31, B, t, D)
    x = (sequence_slice(x) if sequence_parallel else x).requires_grad_()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(32)
    with record_collectives() as log:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, _ = layer(x, causal=True)
        y.backward(torch.ones_like(y) + randn(33, *y.shape))
    return y.detach(), x.grad, dict(layer.named_parameters()), sum(saved), len(list(log))


def check_selective_recompute(rank: int, world: int, sequence_parallel: bool) -> dict[str, float]:
    """The parallel layer with dropout and attention dropout on (attention dropout drawn from
    the rank's tracker stream), with and without selective recomputation from the same
    generator states: largest differences (0 = bitwise equal), bytes saved for backward
    less with it, and collectives more with it (the core has none)."""
    model_parallel_seed(1234, rank, world)
    streams = get_rng_tracker().state_dict()
    y0, gx0, p0, bytes0, comm0 = _recompute_run(False, streams, sequence_parallel)
    y1, gx1, p1, bytes1, comm1 = _recompute_run(True, streams, sequence_parallel)
    get_rng_tracker().reset()
    return {
        "out": err(y1, y0),
        "grad_x": err(gx1, gx0),
        "grad_params": max(err(p1[n].grad, p.grad) for n, p in p0.items()),
        "saved_bytes_less": float(bytes0 - bytes1),
        "collectives_more": float(comm1 - comm0),
    }


def main() -> None:
    rank, world, init_method, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_default_device(sys.argv[5] if len(sys.argv) > 5 else "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    dense = {
        "column": seeded(11, lambda: ColumnParallelLinear(16, 24, stride=3)),
        "row": seeded(12, lambda: RowParallelLinear(24, 16)),
        "embedding": seeded(13, lambda: VocabParallelEmbedding(V, D, padding_idx=PAD)),
        "magneto": dense_transformer_layer("magneto"),
        "preln": dense_transformer_layer("preln"),
        "sp_magneto": dense_transformer_layer("magneto", T_SP),
        "sp_preln": dense_transformer_layer("preln", T_SP),
        "sp_moe": dense_moe_layer(),
    }
    set_parallel_context(build_parallel_context(world))
    results: dict = {"errors": {}, "collectives": {}, "shape": [B, T, D]}
    results["errors"]["column"] = check_column(dense["column"], world)
    results["errors"]["row"] = check_row(dense["row"])
    results["errors"]["embedding"] = check_embedding(dense["embedding"], world)
    results["errors"]["layernorm"] = check_layernorm()
    results["errors"]["cross_entropy"], results["collectives"]["cross_entropy"] = check_cross_entropy(world)
    results["errors"]["linear_cross_entropy"], results["collectives"]["linear_cross_entropy"] = \
        check_linear_cross_entropy(world)
    for backbone in ("magneto", "preln"):
        errors, log = check_transformer_layer(backbone, dense[backbone])
        results["errors"][backbone], results["collectives"][backbone] = errors, log
        errors, log = check_sequence_parallel_layer(backbone, dense[f"sp_{backbone}"])
        results["errors"][f"sp_{backbone}"], results["collectives"][f"sp_{backbone}"] = errors, log
    results["sp_shape"] = [B, T_SP, D]
    results["errors"]["sp_moe"], results["collectives"]["sp_moe"] = check_sequence_parallel_moe_layer(dense["sp_moe"])
    if torch.get_default_device().type == "cpu":  # masks drawn by bernoulli_ (CUDA kernels draw inside)
        results["dropout_masks"] = check_dropout_masks(world)
    results["heads"] = HEADS
    results["selective"] = check_selective_recompute(rank, world, sequence_parallel=False)
    results["selective_sp"] = check_selective_recompute(rank, world, sequence_parallel=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    leave_process_group()


if __name__ == "__main__":
    main()
