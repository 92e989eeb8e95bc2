"""One rank of the activation-checkpointing checks (run by ``test_moe_checkpointing.py``).

``python -m tests.workers.ckpt_worker RANK WORLD INIT_METHOD OUT TP[,TP...]``: on ``WORLD`` gloo ranks,
for each tensor-parallel size ``TP`` in turn (``TP = 1``: the MoE experts are spread over the 2
data-parallel ranks, tokens cross ranks by all-to-all), every model of :data:`MODELS` takes one training
step (criterion forward, backward) twice from the same seed, without and with
``--checkpoint-activations``, dropout and attention dropout on. The reference is the run
without checkpointing. Each rank writes to ``OUT.tpTP.RANK.json``: whether loss, logged figures
and every gradient are bitwise equal, the largest difference otherwise, what the criterion
saw (model calls, MoE entries) and the collectives of the step in the forward pass and
in the backward pass (which runs the recomputation).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from fairseq.criterions import CRITERION_REGISTRY

from benchmarks.collective_recorder import record_collectives
from tests.helpers import model_utils
from tests.helpers.rendezvous import leave_process_group
from torchscale_fairseq.criterions.moe_terms import OutputRecorder
from torchscale_fairseq.model_parallel.parallel_context import (
    build_parallel_context,
    current_parallel_context,
    set_parallel_context,
)
from torchscale_fairseq.model_parallel.random import model_parallel_seed

SEED, BATCH, LENGTH = 3, 4, 12
MOE = dict(moe_expert_count=4, moe_freq=2, moe_top_k=2, moe_capacity_factor=1.0)
SIZES = dict(decoder_embed_dim=32, decoder_ffn_embed_dim=64, decoder_attention_heads=4,
             encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_attention_heads=4,
             dropout=0.1, attention_dropout=0.1, activation_dropout=0.1)
# name: (model kind, flags); 2 MoE layers each (every second FFN)
MODELS = {
    "dense": ("lm", dict(decoder_layers=4)),
    # noisy top-k linear gate (eps ~ N(0, 1) per logit), second expert kept when 2 g2 > U(0, 1)
    "moe_noise_random": ("lm", dict(MOE, decoder_layers=4, moe_router="linear", moe_gate_noise=1.0,
                                    moe_second_expert_policy="random")),
    # the same, the recomputation reusing the all-to-all outputs of the forward pass
    "moe_keep_exchange": ("lm", dict(MOE, decoder_layers=4, moe_router="linear", moe_gate_noise=1.0,
                                     moe_second_expert_policy="random", moe_checkpoint_exchange="keep")),
    # X-MoE router, Gumbel-sampled second expert, balance loss over the data-parallel group
    "moe_sampling_global": ("lm", dict(MOE, decoder_layers=4, moe_router="xmoe", moe_second_expert_policy="sampling",
                                       moe_balance_scope="global")),
    # encoder-decoder (cross-attention recomputed too): one MoE layer in each stack
    "mt_moe_noise_random": ("mt", dict(MOE, encoder_layers=2, decoder_layers=2, moe_router="linear",
                                       moe_gate_noise=1.0, moe_second_expert_policy="random")),
}


def batch(kind: str, dictionary, dp_rank: int) -> tuple[dict, int]:
    """This data-parallel rank's micro-batch (the same on the ranks of one TP group), with
    padding, and the number of tokens its MoE layers route (non-padding tokens entering
    each MoE layer, summed over the layers)."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    pad = dictionary.pad()
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (BATCH, LENGTH + 1), generator=g)
    tokens[0, -4:] = pad
    src, tgt = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(pad).sum(1)},
              "target": tgt, "ntokens": int(tgt.ne(pad).sum()), "nsentences": BATCH}
    if kind == "lm":
        return sample, 2 * int(src.ne(pad).sum())
    prev = torch.cat([torch.full((BATCH, 1), dictionary.eos()), tgt[:, :-1]], dim=1)
    sample["net_input"]["prev_output_tokens"] = prev
    return sample, int(src.ne(pad).sum()) + int(prev.ne(pad).sum())


def step(name: str, checkpoint: bool, tp: int, dictionary) -> dict:
    """Build the model from the seed and take one criterion forward and backward."""
    torch.manual_seed(SEED)
    model_parallel_seed(SEED, current_parallel_context().tensor_rank, tp)
    kind, flags = MODELS[name]
    model = model_utils.build(kind, dictionary, checkpoint_activations=checkpoint, **SIZES, **flags).train()
    criterion = CRITERION_REGISTRY["moe_cross_entropy"](model_utils.FakeTask(dictionary), False)
    criterion.moe_gate_loss_wt = 0.01
    recorder = OutputRecorder(model)
    sample, routed = batch(kind, dictionary, dist.get_rank() // tp)
    torch.manual_seed(SEED + 1)  # the step's draws: dropout, gate noise, second-expert policy
    with record_collectives() as log:
        loss, _, logging_output = criterion(recorder, sample)
        loss.backward()
    return {
        "loss": loss.detach(),
        "logged": {k: v for k, v in logging_output.items() if k.startswith("moe_")},
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "model_calls": len(recorder.outputs),
        "moe_entries": len(recorder.outputs[0][1]["moe"]),
        "routed_tokens": routed,
        "collectives": log,
    }


def compare(off: dict, on: dict) -> dict:
    equal = {"loss": torch.equal(off["loss"], on["loss"]), "logged": off["logged"] == on["logged"]}
    worst = float((off["loss"] - on["loss"]).abs())
    for n, g in off["grads"].items():
        other = on["grads"][n]
        if g is None or other is None:
            equal[n] = g is None and other is None
            continue
        equal[n] = torch.equal(g, other)
        worst = max(worst, float((g - other).abs().max()))
    return {"all_equal": all(equal.values()), "not_equal": [k for k, v in equal.items() if not v],
            "max_abs_diff": worst, "grads": len(off["grads"]), "loss": float(off["loss"]),
            "logged": {"off": off["logged"], "on": on["logged"]}}


def count(log: list, what: str) -> dict[str, int]:
    phases = {"forward": 0, "backward": 0}
    for op, phase, _ in log:
        if op == what:
            phases[phase] += 1
    return phases


def main() -> None:
    rank, world, init_method, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    dictionary = model_utils.dictionary(40)
    for tp in map(int, sys.argv[5].split(",")):
        set_parallel_context(build_parallel_context(tp))
        results: dict = {"moe_layers": 2}
        for name in MODELS:
            off, on = step(name, False, tp, dictionary), step(name, True, tp, dictionary)
            results[name] = compare(off, on)
            for key, run in (("off", off), ("on", on)):
                results[name][key] = {
                    "model_calls": run["model_calls"], "moe_entries": run["moe_entries"],
                    "routed_tokens": run["routed_tokens"],
                    **{op: count(run["collectives"], op) for op in ("all_to_all_single", "all_gather", "all_reduce")},
                }
        with open(f"{out}.tp{tp}.{rank}.json", "w") as f:
            json.dump(results, f, indent=1)
    leave_process_group()


if __name__ == "__main__":
    main()
