"""``--zero-sharding full`` (:mod:`torchscale_fairseq.optim.fully_sharded`, FSDP2) through
``fairseq-train``, two data-parallel ranks on CPU (gloo, one thread each, fp32), against plain DDP
(the same run without sharding) and one process (``--update-freq 2``: the same batches per update):

- per-update loss and ``gnorm``, and the validation loss, equal as logged (6 significant digits,
  as ``test_zero_sharding``): the reduce-scatter averages what DDP's all-reduce averages; also
  at TP=2 x DP=2 with sequence parallelism (the DP mesh is the data-parallel group of each part);
- each rank's Adam moments are half of the model's (every parameter split on dimension 0);
- the checkpoint holds the unsharded run's state, bitwise;
- resuming from the update-2 checkpoint goes on exactly: ``full`` and ``os`` from ``full`` (with the
  checkpoint equal to none's bitwise, one format serves all three, so ``ts-reshard`` has nothing
  to convert between them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import torchscale_fairseq  # noqa: F401  (the checkpoint allow-list)
from tests.helpers.cli_utils import LM_TRAIN, WORKERS
from tests.helpers.mp_helpers import USER_DIR, dist_flags, launch, train_records, wait_all
from tests.helpers.rendezvous import rendezvous_url
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.optim.fully_sharded import check_fully_sharded

ZERO_CLI = WORKERS / "zero_cli.py"
UPDATES = 4
TINY = ["--arch", "ts_lm_tiny", "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "2"]
FULL = ["--zero-sharding", "full"]
TP = ["--model-parallel-size", "2", "--sequence-parallel"]


def _command(data: Path, save: Path, *flags: str) -> list[str]:
    return [str(data), *TINY, *LM_TRAIN, "--batch-size", "8", "--dropout", "0", "--log-interval", "1",
            "--max-update", str(UPDATES), "--save-interval-updates", "2", "--validate-interval-updates", "2",
            "--num-workers", "0", "--save-dir", str(save), "--user-dir", str(USER_DIR), *flags]


def _start(args: list[str], out: Path, world: int = 2) -> tuple[list, list[Path]]:
    init_method = rendezvous_url(out)
    procs, logs = [], []
    for rank in range(world):
        logs.append(out / f"{rank}.log")
        procs.append(launch([sys.executable, str(ZERO_CLI), "0", *args, *dist_flags(world, rank, init_method)],
                            logs[-1]))
    return procs, logs


def _losses(log: Path) -> dict[int, tuple[float, float]]:
    return {int(r["num_updates"]): (float(r["loss"]), float(r["gnorm"])) for r in train_records(log)}


def _valid_losses(log: Path) -> dict[int, float]:
    """``valid_loss`` by update, from fairseq's json ``valid`` records."""
    out = {}
    for line in log.read_text().splitlines():
        if "valid_loss" in line and "{" in line:
            record = json.loads(line[line.index("{"):])
            out[int(record["valid_num_updates"])] = float(record["valid_loss"])
    return out


def _state_numels(log: Path) -> dict:
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("optimizer-state ")]
    return json.loads(lines[-1][len("optimizer-state "):])


@pytest.fixture(scope="module")
def runs(lm_data, tmp_path_factory) -> dict:
    """DP=2 plain and full and one process, then resumes from the update-2 checkpoints, two runs
    at a time."""
    root = tmp_path_factory.mktemp("fsdp")

    def start(name: str, *flags: str, world: int = 2) -> tuple[list, list[Path]]:
        return _start(_command(lm_data, root / name / "save", *flags), root / name, world)

    def resume(name: str, source: str, *flags: str) -> tuple[list, list[Path]]:
        restore = str(root / source / "save" / "checkpoint_1_2.pt")
        return start(name, "--restore-file", restore, *flags)

    plan = [("ddp", lambda: start("ddp")), ("full", lambda: start("full", *FULL)),
            ("one", lambda: start("one", "--update-freq", "2", world=1)),
            ("full-from-full", lambda: resume("full-from-full", "full", *FULL)),
            ("os-from-full", lambda: resume("os-from-full", "full", "--zero-sharding", "os")),
            ("tp", lambda: start("tp", *FULL, *TP, world=4))]
    logs = {}
    for pair in (plan[:2], plan[2:4], plan[4:5], plan[5:]):  # the resumes need the first two's checkpoints
        started = [(name, begin()) for name, begin in pair]
        for name, (procs, run_logs) in started:
            wait_all(procs, run_logs)
            logs[name] = run_logs
    return {"root": root, **logs}


def test_full_equals_ddp_and_one_process_per_update(runs):
    ddp = _losses(runs["ddp"][0])
    assert sorted(ddp) == list(range(1, UPDATES + 1))
    assert _losses(runs["full"][0]) == ddp
    assert _losses(runs["one"][0]) == ddp
    valid = _valid_losses(runs["ddp"][0])
    assert sorted(valid) == [2, 4]
    assert _valid_losses(runs["full"][0]) == valid == _valid_losses(runs["one"][0])


def test_full_under_tensor_parallelism_equals_ddp(runs):
    """TP=2 x DP=2 (sequence-parallel): each tensor-parallel part sharded over its data-parallel
    group, the same per-update loss, ``gnorm`` and validation loss as DP=2 without either."""
    assert _losses(runs["tp"][0]) == _losses(runs["ddp"][0])
    assert _valid_losses(runs["tp"][0]) == _valid_losses(runs["ddp"][0])
    parts = sorted(p.name for p in (runs["root"] / "tp" / "save").glob("checkpoint_last*.pt"))
    assert parts == ["checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"]


def test_each_rank_holds_half_the_moments(runs):
    """Every parameter is split on dimension 0 (rows ``ceil(n/2)`` and ``floor(n/2)``)."""
    total = _state_numels(runs["ddp"][0])["dense"]
    got = [_state_numels(log) for log in runs["full"]]
    assert got[0]["updates"] == UPDATES and got[0]["dense"] + got[1]["dense"] == total > 0
    for rank in range(2):
        assert abs(got[rank]["dense"] - total / 2) <= 0.02 * total, (got, total)


def test_checkpoint_holds_the_unsharded_state(runs):
    """``checkpoint_last`` (update 4): bitwise the parameters and Adam moments DDP saved."""
    ref = torch.load(runs["root"] / "ddp" / "save" / "checkpoint_last.pt", weights_only=True)
    got = torch.load(runs["root"] / "full" / "save" / "checkpoint_last.pt", weights_only=True)
    assert ref["model"].keys() == got["model"].keys()
    for key, value in ref["model"].items():
        assert type(got["model"][key]) is torch.Tensor and torch.equal(value, got["model"][key]), key
    ref_state, got_state = ref["last_optimizer_state"]["state"], got["last_optimizer_state"]["state"]
    assert sorted(ref_state) == sorted(got_state)
    for index, fields in ref_state.items():
        for field, value in fields.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(got_state[index][field])), (index, field)


@pytest.mark.parametrize("name", ["full-from-full", "os-from-full"])
def test_resume_goes_on_exactly(runs, name):
    """Updates 3 and 4 after loading the update-2 checkpoint of another (or the same) mode."""
    text = runs[name][0].read_text()
    assert "Loaded checkpoint" in text and "@ 2 updates" in text
    ddp, got = _losses(runs["ddp"][0]), _losses(runs[name][0])
    assert sorted(got) == [3, 4]
    assert all(got[u] == ddp[u] for u in got), (ddp, got)
    assert _valid_losses(runs[name][0])[4] == _valid_losses(runs["ddp"][0])[4]


def _cfg(zero: str = "full", **common):
    from types import SimpleNamespace as NS

    flags = {"fp16": False, "bf16": False, "memory_efficient_fp16": False, "memory_efficient_bf16": False,
             "amp": False, **common}
    return NS(common=NS(**flags), distributed_training=NS(zero_sharding=zero, ddp_backend="pytorch_ddp"),
              optimization=NS(use_bmuf=False), ema=NS(store_ema=False))


@pytest.mark.parametrize("common, size, pipeline, experts, message", [
    ({}, 1, 1, False, "drop --zero-sharding or train on more ranks"),
    ({"fp16": True}, 2, 1, False, "use --bf16, or --zero-sharding os"),
    ({"memory_efficient_bf16": True}, 2, 1, False, "use --bf16"),
    ({}, 2, 2, False, "--pipeline-model-parallel-size > 1"),
    ({}, 2, 1, True, "with experts"),
])
def test_refused_before_any_work(common, size, pipeline, experts, message):
    with pytest.raises(TsConfigError, match=message):
        check_fully_sharded(_cfg(**common), size, pipeline, experts)
    check_fully_sharded(_cfg(bf16=True), 2, 1, False)
    check_fully_sharded(_cfg("none", **common), size, pipeline, experts)


def test_other_ddp_backends_refused():
    cfg = _cfg()
    cfg.distributed_training.ddp_backend = "legacy_ddp"
    with pytest.raises(TsConfigError, match="drop --ddp-backend"):
        check_fully_sharded(cfg, 2, 1, False)
