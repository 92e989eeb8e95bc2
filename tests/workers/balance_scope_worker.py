"""Two gloo ranks run one MoE layer on different token counts with each
``--moe-balance-scope``; each rank checks ``balance_loss`` against the definition computed
by hand from both ranks' tokens (regenerated from the seed, no communication).
Usage: ``python -m tests.workers.balance_scope_worker INIT_METHOD``."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests.helpers.rendezvous import leave_process_group, start_ranks

EXPERTS, DIM = 4, 8
TOKENS = (6, 11)


def hand_balance(probs: torch.Tensor, first: torch.Tensor) -> float:
    """``E * sum_e f_e p_e`` written out: ``f_e`` first-choice fraction, ``p_e`` mean probability."""
    n = probs.size(0)
    total = 0.0
    for e in range(EXPERTS):
        f_e = sum(1 for t in range(n) if int(first[t]) == e) / n
        p_e = sum(float(probs[t, e]) for t in range(n)) / n
        total += f_e * p_e
    return EXPERTS * total


def worker(rank: int, init_method: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    from torchscale_fairseq.model_parallel.parallel_context import build_parallel_context
    from torchscale_fairseq.modules.feedforward import FFNSpec
    from torchscale_fairseq.modules.moe.config import MoEConfig
    from torchscale_fairseq.modules.moe.layer import MoELayer

    experts = build_parallel_context(1).expert_parallel(EXPERTS)
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(1, n, DIM, generator=g) * 3 for n in TOKENS]
    for scope in ("local", "global"):
        torch.manual_seed(0)  # the router is replicated: same weights on both ranks
        layer = MoELayer(MoEConfig(expert_count=EXPERTS, top_k=2, capacity_factor=0.0, balance_scope=scope), FFNSpec(DIM, 16),
                         parallel=experts)
        _, aux = layer(inputs[rank])
        with torch.no_grad():
            probs = [torch.softmax(layer.router(x.reshape(-1, DIM)), -1) for x in inputs]
        firsts = [p.argmax(-1) for p in probs]
        if scope == "local":
            expected = hand_balance(probs[rank], firsts[rank])
        else:
            # this rank's share: the whole group's loss, split by where the probabilities sit
            both, first_both = torch.cat(probs), torch.cat(firsts)
            n = both.size(0)
            f = [sum(1 for t in range(n) if int(first_both[t]) == e) / n for e in range(EXPERTS)]
            expected = EXPERTS * sum(f[e] * float(probs[rank][:, e].sum()) / n for e in range(EXPERTS))
            shares = torch.tensor([float(aux.balance_loss)])
            dist.all_reduce(shares)
            whole = hand_balance(both, first_both)
            assert abs(float(shares) - whole) < 1e-5, (scope, float(shares), whole)
            assert abs(whole - sum(hand_balance(p, f) for p, f in zip(probs, firsts)) / 2) > 1e-3, \
                "the test data must tell the two scopes apart"
        assert abs(float(aux.balance_loss) - expected) < 1e-5, (scope, rank, float(aux.balance_loss), expected)
    leave_process_group()


if __name__ == "__main__":
    start_ranks(worker, (sys.argv[1],), 2)
