"""``ts-reshard``'s tensor logic in one process: vocabulary padding and fused Q/K/V
strides survive 2 -> 1 -> 2, per-parameter optimizer moments are resharded with their
parameters, and a flat (fp16) optimizer state is dropped rather than mis-assigned."""

from __future__ import annotations

import torch

from torchscale_fairseq.checkpoints.convert import reshard_states
from torchscale_fairseq.checkpoints.layout import RECORD_KEY as TP_STATE_KEY
from torchscale_fairseq.model_parallel.partition import padded_vocab_size, shard_tensor

VOCAB, DIM = 300, 4
LAYOUT = {
    "embed": {"dim": 0, "stride": 1, "vocab": VOCAB},
    "qkv": {"dim": 0, "stride": 3, "vocab": None},
}
NAMES = ["embed", "qkv", "norm"]


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(VOCAB, DIM, generator=g), "qkv": torch.randn(12, DIM, generator=g),
            "norm": torch.randn(DIM, generator=g)}


def _parts(size: int, optimizer: str = "adam") -> list[dict]:
    full = _full()
    padded = torch.cat([full["embed"], torch.zeros(padded_vocab_size(VOCAB, size) - VOCAB, DIM)])
    parts = []
    for rank in range(size):
        model = {
            "embed": shard_tensor(padded, 0, 1, rank, size),
            "qkv": shard_tensor(full["qkv"], 0, 3, rank, size),
            "norm": full["norm"],
        }
        if optimizer == "adam":
            moments = {i: {"step": 5, "exp_avg": 2 * model[n], "exp_avg_sq": model[n] ** 2}
                       for i, n in enumerate(NAMES)}
        else:
            moments = {0: {"exp_avg": torch.zeros(sum(t.numel() for t in model.values()))}}
        parts.append({
            "model": model,
            "cfg": {"common": {"model_parallel_size": size}, "checkpoint": {"checkpoint_suffix": ""}},
            "last_optimizer_state": {"state": moments, "param_groups": [{"lr": 1.0}]},
            "extra_state": {TP_STATE_KEY: {"size": size, "layout": LAYOUT, "params": NAMES, "rng": {}}},
        })
    return parts


def test_round_trip_restores_every_tensor():
    two = _parts(2)
    one = reshard_states(two, 1)
    assert torch.equal(one[0]["model"]["embed"], _full()["embed"])
    assert torch.equal(one[0]["model"]["qkv"], _full()["qkv"])
    assert one[0]["cfg"]["common"]["model_parallel_size"] == 1
    assert torch.equal(one[0]["last_optimizer_state"]["state"][0]["exp_avg"], 2 * _full()["embed"])
    back = reshard_states(one, 2)
    for rank in range(2):
        for name in NAMES:
            assert torch.equal(back[rank]["model"][name], two[rank]["model"][name]), name
        for index, entry in two[rank]["last_optimizer_state"]["state"].items():
            for key, value in entry.items():
                got = back[rank]["last_optimizer_state"]["state"][index][key]
                assert torch.equal(got, value) if torch.is_tensor(value) else got == value


def test_flat_optimizer_state_is_dropped():
    assert all("last_optimizer_state" not in s for s in reshard_states(_parts(2, "flat"), 1))
