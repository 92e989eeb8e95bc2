"""``--checkpoint-activations`` composes with MoE, tensor parallelism and dropout (issue 15,
item 2). Reference: the same model and step without checkpointing. On 2 gloo ranks, at
tensor-parallel size 1 (experts spread over the 2 ranks, tokens exchanged by all-to-all)
and 2, with dropout and attention dropout on, for a dense model and two X-MoE models with
random routing draws (noisy gate + ``random`` second expert, LM and encoder-decoder; Gumbel
``sampling`` with the global balance scope): the loss, the logged MoE figures and every gradient are bitwise
equal; the criterion sees one model call and one balance-loss entry per MoE layer, its
token count being the non-padding tokens entering the MoE layers; the forward pass
sends the same collectives, and the recomputation in backward sends only the two
all-to-alls of each MoE layer (dispatch and combine, whose outputs backward needs), none
with ``--moe-checkpoint-exchange keep``, and no count all-gather or balance-loss all-reduce."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.helpers.mp_helpers import launch, wait_all
from tests.helpers.rendezvous import rendezvous_url
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.layer import MoELayer, RecomputeMemo

WORLD = 2
MOE_MODELS = ("moe_noise_random", "moe_keep_exchange", "moe_sampling_global", "mt_moe_noise_random")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """``{tp: [rank 0 results, rank 1 results]}``; the same 2 processes run both TP sizes."""
    out = tmp_path_factory.mktemp("ckpt")
    init_method = rendezvous_url(out)
    logs = [out / f"rank{rank}.log" for rank in range(WORLD)]
    procs = [launch([sys.executable, "-m", "tests.workers.ckpt_worker", str(rank), str(WORLD), init_method,
                     str(out / "step"), "1,2"], logs[rank]) for rank in range(WORLD)]
    wait_all(procs, logs, timeout=240)
    return {tp: [json.loads((out / f"step.tp{tp}.{rank}.json").read_text()) for rank in range(WORLD)] for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["dense", *MOE_MODELS])
def test_checkpointing_changes_nothing(results, tp, model):
    for rank, res in enumerate(results[tp]):
        r = res[model]
        assert r["all_equal"], f"rank {rank}: not bitwise equal: {r['not_equal']} (max abs diff {r['max_abs_diff']})"
        assert r["grads"] > 0


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["dense", *MOE_MODELS])
def test_balance_loss_and_routing_stats_recorded_once(results, tp, model):
    for res in results[tp]:
        layers = res["moe_layers"] if model != "dense" else 0
        for run in ("off", "on"):
            assert res[model][run]["model_calls"] == 1
            assert res[model][run]["moe_entries"] == layers
            logged = res[model]["logged"][run]
            if layers:
                assert logged["moe_layers"] == 1
                assert logged["moe_tokens"] == res[model][run]["routed_tokens"]


@pytest.mark.parametrize("model", ["dense", *MOE_MODELS])
def test_tensor_parallel_ranks_agree(results, model):
    """Both TP ranks compute the loss of the same micro-batch (replicated routers route alike)."""
    assert results[2][0][model]["loss"] == results[2][1][model]["loss"]


@pytest.mark.parametrize("model", MOE_MODELS)
def test_recompute_repeats_only_the_all_to_alls(results, model):
    """Per MoE layer and step at TP 1 on 2 ranks: forward 2 all-to-alls and 1 count
    all-gather either way; backward 2 all-to-alls without checkpointing, 4 with it (2 with
    the all-to-all outputs kept)."""
    recomputed = 0 if model == "moe_keep_exchange" else 2
    for res in results[1]:
        layers, off, on = res["moe_layers"], res[model]["off"], res[model]["on"]
        assert off["all_to_all_single"] == {"forward": 2 * layers, "backward": 2 * layers}
        assert on["all_to_all_single"] == {"forward": 2 * layers, "backward": (2 + recomputed) * layers}
        assert off["all_gather"] == on["all_gather"] == {"forward": layers, "backward": 0}
        assert on["all_reduce"] == off["all_reduce"]  # global scope: the balance totals, forward only
        assert off["all_reduce"]["backward"] == 0


@pytest.mark.parametrize("model", ["dense", *MOE_MODELS])
def test_no_all_to_all_without_expert_parallelism(results, model):
    for res in results[2]:
        for run in ("off", "on"):
            assert res[model][run]["all_to_all_single"] == {"forward": 0, "backward": 0}


def _memo_call(layer, x: torch.Tensor, memo: RecomputeMemo, seed: int):
    torch.manual_seed(seed)  # what the checkpoint replays before the recomputation
    return layer(x, memo=memo)


def test_memo_reuses_the_first_run_and_refuses_other_routing():
    """One process: a replayed call (same input, same generator state) gives the same output
    and balance loss and hands back the first run's statistics; other routing (here another
    input) is one error naming the layer instead of a silent mismatch or a hang."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(expert_count=4, top_k=2, router="linear", gate_noise=1.0, capacity_factor=1.0),
                     FFNSpec(8, 16, activation_dropout=0.1), tag="dec1").train()
    x = torch.randn(2, 16, 8)
    memo = RecomputeMemo()
    y, aux = _memo_call(layer, x, memo, 5)
    assert memo.filled and sum(memo.counts) == aux.stats.routed - aux.stats.dropped
    y2, aux2 = _memo_call(layer, x, memo, 5)
    assert torch.equal(y, y2) and torch.equal(aux.balance_loss, aux2.balance_loss)
    assert aux2.stats is aux.stats
    with pytest.raises(RuntimeError, match="'dec1' routed differently when activation checkpointing recomputed"):
        _memo_call(layer, x.flip(1), memo, 5)
