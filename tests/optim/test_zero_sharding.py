"""``--zero-sharding os`` (:mod:`torchscale_fairseq.optim.zero`) through ``fairseq-train``,
two data-parallel ranks on CPU (gloo, one thread each), against the same runs without it:

- per-update loss and ``gnorm`` equal as logged (6 significant digits; fp32: the owner computes
  the update the unsharded optimizer computes and the broadcast copies it, so the final
  parameters and moments are bitwise equal, checked too), for dense Adam and for
  SparseClip around Adam on an X-MoE model (experts spread over the two ranks);
- each rank's Adam moments cover half the dense parameters, up to one parameter
  (``|n_r - N/2| <= largest``, ``n_0 + n_1 = N``), and each rank's own experts fully;
- checkpoints hold the state an unsharded run saves (every rank's file under MoE);
- a run SIGKILLed after update 3 and restarted from its update-2 checkpoint goes on exactly
  (the dense sharded run is that run: killed, restarted, compared with the unsharded one).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import torchscale_fairseq  # noqa: F401  (the checkpoint allow-list)
from tests.helpers.cli_utils import LM_TRAIN, WORKERS
from tests.helpers.mp_helpers import USER_DIR, dist_flags, launch, train_records, wait_all
from tests.helpers.rendezvous import rendezvous_url
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.optim.zero import assign_owners, check_zero_sharding

ZERO_CLI = WORKERS / "zero_cli.py"
UPDATES = 4
TINY = ["--arch", "ts_lm_tiny", "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "2"]
MOE = ["--moe-expert-count", "4", "--moe-freq", "2", "--moe-gate-noise", "0.0", "--criterion", "moe_cross_entropy",
       "--optimizer", "sparse_clip", "--sparse-clip-base", "adam", "--clip-norm", "0.5"]
ZERO = ["--zero-sharding", "os"]


def _command(data: Path, save: Path, *flags: str) -> list[str]:
    return [str(data), *TINY, *LM_TRAIN, "--batch-size", "8", "--dropout", "0", "--log-interval", "1",
            "--max-update", str(UPDATES), "--save-interval-updates", "2", "--disable-validation", "--num-workers",
            "0", "--save-dir", str(save), "--user-dir", str(USER_DIR), *flags]


def _start(args: list[str], out: Path, stall: int) -> tuple[list, list[Path]]:
    init_method = rendezvous_url(out)
    procs, logs = [], []
    for rank in range(2):
        logs.append(out / f"{rank}.log")
        procs.append(launch([sys.executable, str(ZERO_CLI), str(stall), *args, *dist_flags(2, rank, init_method)],
                            logs[-1]))
    return procs, logs


def _state_numels(log: Path) -> dict:
    """The last ``optimizer-state`` record of a :mod:`zero_cli` log."""
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("optimizer-state ")]
    return json.loads(lines[-1][len("optimizer-state "):])


def _losses(log: Path) -> dict[int, tuple[float, float]]:
    return {int(r["num_updates"]): (float(r["loss"]), float(r["gnorm"])) for r in train_records(log)}


def _kill_after(procs: list, log: Path, update: int) -> None:
    """SIGKILL the ranks of a run stalling after ``update`` once rank 0 has logged it."""
    while not any(r["num_updates"] == str(update) for r in train_records(log)):
        assert procs[0].poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def runs(lm_data, tmp_path_factory) -> dict:
    """DP=2 without and with sharding, dense and MoE, two runs at a time. The dense sharded
    run is SIGKILLed after update 3 and restarted (from its update-2 checkpoint)."""
    root = tmp_path_factory.mktemp("zero")

    def start(model: str, name: str, stall: int = 0) -> tuple[list, list[Path]]:
        flags = (MOE if model == "moe" else []) + (ZERO if name != "ref" else [])
        save = root / model / ("zero" if name != "ref" else "ref") / "save"
        return _start(_command(lm_data, save, *flags), root / model / name, stall)

    dense_ref, killed = start("dense", "ref"), start("dense", "killed", stall=3)
    _kill_after(*killed[:1], killed[1][0], 3)
    wait_all(*dense_ref)
    resumed, moe_ref = start("dense", "resumed"), start("moe", "ref")
    wait_all(*resumed)
    wait_all(*moe_ref)
    moe_zero = start("moe", "zero")
    wait_all(*moe_zero)
    return {("dense", "ref"): dense_ref[1], ("dense", "killed"): killed[1], ("dense", "zero"): resumed[1],
            ("moe", "ref"): moe_ref[1], ("moe", "zero"): moe_zero[1], "root": root}


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_sharded_equals_unsharded_per_update(runs, model):
    ref, got = _losses(runs[model, "ref"][0]), _losses(runs[model, "zero"][0])
    assert sorted(ref) == list(range(1, UPDATES + 1))
    if model == "dense":  # killed after 3 (and resumed from 2: test_sigkill_then_restart_is_exact)
        got = {**_losses(runs["dense", "killed"][0]), **got}
    assert got == ref  # equal as logged (6 significant digits); bitwise at the end: test_checkpoint_...


def test_sigkill_then_restart_is_exact(runs):
    """Rank 0 read the consolidated state at update 2, every rank kept its part, and the
    updates after the restart are the uninterrupted run's."""
    text = runs["dense", "zero"][0].read_text()
    assert "Loaded checkpoint" in text and "@ 2 updates" in text
    ref, got = _losses(runs["dense", "ref"][0]), _losses(runs["dense", "zero"][0])
    assert sorted(got) == list(range(3, UPDATES + 1))
    assert all(got[u] == ref[u] for u in got), (ref, got)


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_each_rank_holds_half_the_moments(runs, model):
    """After the last update (for the dense run: after the restart, so loading kept only
    the owned part)."""
    ref = [_state_numels(log) for log in runs[model, "ref"]]
    got = [_state_numels(log) for log in runs[model, "zero"]]
    total = ref[0]["dense"]
    assert ref[0]["dense"] == ref[1]["dense"] > 0 and got[0]["updates"] == UPDATES
    assert got[0]["dense"] + got[1]["dense"] == total
    for rank in range(2):
        # two moments per element; the split is by whole parameters
        assert abs(got[rank]["dense"] - total / 2) <= 2 * got[rank]["largest"], (rank, got, total)
        assert got[rank]["expert"] == ref[rank]["expert"]  # experts stay local and unsharded
    if model == "moe":
        assert got[0]["expert"] > 0


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_checkpoint_holds_the_unsharded_state(runs, model):
    """``checkpoint_last`` (update 4) of both runs: bitwise the same parameters and optimizer
    state (every rank's file under MoE, each with the whole dense state and its own experts')."""
    ref_dir, zero_dir = runs["root"] / model / "ref" / "save", runs["root"] / model / "zero" / "save"
    files = sorted(p.name for p in ref_dir.glob("checkpoint_last*.pt"))
    assert files == sorted(p.name for p in zero_dir.glob("checkpoint_last*.pt"))
    assert len(files) == (2 if model == "moe" else 1)
    for name in files:
        ref_file = torch.load(ref_dir / name, weights_only=True)
        got_file = torch.load(zero_dir / name, weights_only=True)
        assert ref_file["model"].keys() == got_file["model"].keys()
        for key, value in ref_file["model"].items():
            assert torch.equal(value, got_file["model"][key]), (name, key)
        ref, got = ref_file["last_optimizer_state"], got_file["last_optimizer_state"]
        assert sorted(ref["state"]) == sorted(got["state"])
        for key, fields in ref["state"].items():
            for field, value in fields.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(got["state"][key][field])), (name, key)


def test_owners_split_by_size():
    """Largest first to the least loaded rank; local parameters owned by none."""
    owners = assign_owners([10, 7, 5, 3, 1], 2, [False, False, False, True, False])
    assert owners == [0, 1, 1, -1, 0]


def _cfg(**common):
    from types import SimpleNamespace as NS

    flags = {"fp16": False, "bf16": False, "memory_efficient_fp16": False, "memory_efficient_bf16": False,
             "amp": False, "fp16_no_flatten_grads": False, **common}
    return NS(common=NS(**flags), distributed_training=NS(zero_sharding="os", ddp_backend="pytorch_ddp"),
              optimization=NS(use_bmuf=False))


@pytest.mark.parametrize("common, size, message", [
    ({}, 1, "drop --zero-sharding or train on more ranks"),
    ({"fp16": True}, 2, "add --fp16-no-flatten-grads"),
    ({"bf16": True}, 2, "add --fp16-no-flatten-grads"),
])
def test_refused_before_any_work(common, size, message):
    with pytest.raises(TsConfigError, match=message):
        check_zero_sharding(_cfg(**common), size)
    check_zero_sharding(_cfg(**common, fp16_no_flatten_grads=True), 2)


def test_load_keeps_the_saved_state_dtypes(tmp_path):
    """``--memory-efficient-fp16``: fp16 parameters, fp32 Adam moments; torch's loader would
    cast the moments to fp16 (fairseq's loader hack is turned off for the sharded state), ours
    keeps them (one process: a group of one owns everything)."""
    import torch.distributed as dist
    from fairseq.optim.adam import Adam

    from torchscale_fairseq.optim.zero import ShardedOptimizerState

    dist.init_process_group("gloo", init_method=rendezvous_url(tmp_path), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        param = torch.nn.Parameter(torch.randn(6).half())
        param.grad = torch.randn(6).half()
        saver = ShardedOptimizerState(Adam([param], lr=0.1), group)
        saver.step()
        saver.consolidate_state_dict()
        saved = saver.state_dict()
        assert saved["state"][0]["exp_avg"].dtype == torch.float32
        loader = ShardedOptimizerState(Adam([param], lr=0.1), group)
        loader.load_state_dict(saved)
        for key in ("exp_avg", "exp_avg_sq"):
            assert loader.state[param][key].dtype == torch.float32
            assert torch.equal(loader.state[param][key], saved["state"][0][key])
    finally:
        dist.destroy_process_group()
