"""SIGKILL both ranks of a tensor-parallel (N=2) or pipeline-parallel (P=2) run mid-epoch,
restart: the updates after the restart equal those of an uninterrupted run, the checkpoint
parts (stages) bitwise (saves every 2 updates, killed after update 3: 2 updates on each side
of the cut). Dropout and attention dropout are on, so the tensor-parallel RNG
tracker (and each stage's dropout stream) must come back too.

The uninterrupted run also shows Megatron's replication invariant with dropout on: after
its 4 updates every tensor the parameter-attribute registry does not mark as split
(LayerNorms, row-parallel biases), with its Adam moments, is bitwise identical in the two
ranks' parts, and every split one differs (the per-rank dropout streams of
``model_parallel/random.py`` stay inside the parallel regions).

A kill between the two ranks' writes of ``checkpoint_last`` leaves parts of different
updates: the restart is refused in one line naming the newest complete checkpoint (ranks
resuming from different updates would wait on each other forever), and resuming from it
is exact too; the same for a pipeline's stages.

The pipeline run (4 layers, tied embeddings, 1F1B over 2 micro-batches) also shows that the
last stage's copy of the tied embedding stays bitwise equal to the first stage's embedding,
with its Adam moments, after 4 updates with dropout on; resuming it with another split or on
one process is refused in one line naming the conversion."""

import json
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

import torchscale_fairseq  # noqa: F401  (the checkpoint allow-list)
from tests.helpers.cli_utils import LM_TRAIN, WORKERS
from tests.helpers.mp_helpers import (
    USER_DIR,
    assert_replicated_across_parts,
    dist_flags,
    fairseq_ranks,
    launch,
    run_fairseq,
    wait_all,
)
from tests.helpers.rendezvous import rendezvous_url

STALL_CLI = WORKERS / "stall_cli.py"
MAX_UPDATE, SAVE_EVERY = 4, 2

ARGS = ["--arch", "ts_lm_tiny", *LM_TRAIN, "--batch-size", "8", "--max-update", str(MAX_UPDATE),
        "--save-interval-updates", str(SAVE_EVERY),
        "--log-interval", "1", "--disable-validation", "--dropout", "0.1", "--attention-dropout", "0.1",
        "--model-parallel-size", "2", "--ddp-backend", "legacy_ddp"]
ARGS.remove("--cpu")


def _losses(log) -> dict:
    out = {}
    for line in log.read_text().splitlines():
        if "| train_inner |" in line:
            record = json.loads(line[line.index("{"):])
            out[int(record["num_updates"])] = record["loss"]
    return out


def _kill_after(args, out, update: int) -> None:
    """Run ``fairseq-train`` on 2 ranks that stall once ``update`` updates are logged; SIGKILL both."""
    init_method = rendezvous_url(out)
    procs = [launch([sys.executable, str(STALL_CLI), str(update), *args, "--user-dir", str(USER_DIR), "--cpu",
                     *dist_flags(2, rank, init_method)], out / f"fairseq-train.{rank}.log") for rank in range(2)]
    log = out / "fairseq-train.0.log"
    deadline = time.monotonic() + 600
    while update not in _losses(log):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log.read_text()[-3000:]
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()


def _assert_resumed_exactly(ref_dir, run_dir, ref_log, resumed_log, from_update: int, suffixes) -> None:
    text = resumed_log.read_text()
    assert "Loaded checkpoint" in text and f"@ {from_update} updates" in text
    want, got = _losses(ref_log), _losses(resumed_log)
    assert sorted(got) == list(range(from_update + 1, MAX_UPDATE + 1))
    assert all(got[u] == want[u] for u in got), (want, got)
    for suffix in suffixes:
        a = torch.load(ref_dir / f"checkpoint_last{suffix}.pt", weights_only=True)["model"]
        b = torch.load(run_dir / f"checkpoint_last{suffix}.pt", weights_only=True)["model"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _sigkill_restart_and_torn_save(lm_data, tmp_path, args, suffixes, refused=None) -> Path:
    """The uninterrupted run, the killed and restarted one, and a save torn between the two ranks'
    files (``suffixes``: each rank's file suffix); returns the uninterrupted run's save dir.
    ``refused(ref_dir)``: starts further runs that read the uninterrupted run's checkpoint and
    must fail, beside the restarts (their processes; checked by the caller once they end).
    Three rounds of processes: the uninterrupted run beside the killed one; the restart beside the
    torn save's refused start (and ``refused``); the restart from the checkpoint the refusal names."""
    ref_dir, run_dir, torn_dir = tmp_path / "ref", tmp_path / "run", tmp_path / "torn"
    ref_procs, ref = fairseq_ranks("fairseq-train", [str(lm_data), "--save-dir", str(ref_dir), *args], 2,
                                   tmp_path / "ref_logs")
    _kill_after([str(lm_data), "--save-dir", str(run_dir), *args], tmp_path / "killed_logs", update=SAVE_EVERY + 1)
    wait_all(ref_procs, ref)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        f"checkpoint_{n}{suffix}.pt" for n in (f"1_{SAVE_EVERY}", "last") for suffix in suffixes]

    # killed while saving update 4: rank 0's file of checkpoint_last and of checkpoint_1_4 written, rank 1's not
    first, second = f"checkpoint_1_{SAVE_EVERY}", f"checkpoint_1_{2 * SAVE_EVERY}"
    torn_dir.mkdir()
    for name in (*(f"{first}{suffix}.pt" for suffix in suffixes), f"{second}{suffixes[0]}.pt"):
        shutil.copy(ref_dir / name, torn_dir / name)
    shutil.copy(ref_dir / f"{second}{suffixes[0]}.pt", torn_dir / f"checkpoint_last{suffixes[0]}.pt")
    shutil.copy(ref_dir / f"{first}{suffixes[1]}.pt", torn_dir / f"checkpoint_last{suffixes[1]}.pt")
    torn_args = [str(lm_data), "--save-dir", str(torn_dir), *args]

    resumed_procs, resumed = fairseq_ranks("fairseq-train", [str(lm_data), "--save-dir", str(run_dir), *args], 2,
                                           tmp_path / "resumed_logs")
    torn_procs, torn_logs = fairseq_ranks("fairseq-train", torn_args, 2, tmp_path / "torn_logs")
    others = refused(ref_dir) if refused else []
    wait_all(resumed_procs, resumed)
    _assert_resumed_exactly(ref_dir, run_dir, ref[0], resumed[0], SAVE_EVERY, suffixes)
    restore = torn_dir / f"{first}.pt"
    for log in wait_failing(torn_procs, torn_logs):
        errors = [ln for ln in log.read_text().splitlines() if "different updates" in ln]
        assert errors and f"--restore-file {restore}" in errors[-1], log.read_text()[-2000:]
        assert f"@ {2 * SAVE_EVERY}" in errors[-1] and f"@ {SAVE_EVERY}" in errors[-1]
    restored = run_fairseq("fairseq-train", [*torn_args, "--restore-file", str(restore)], 2,
                           tmp_path / "restored_logs")
    _assert_resumed_exactly(ref_dir, torn_dir, ref[0], restored[0], SAVE_EVERY, suffixes)
    for procs, logs in others:
        wait_failing(procs, logs)
    return ref_dir


def test_tensor_parallel_sigkill_then_restart_is_exact(lm_data, tmp_path):
    ref_dir = _sigkill_restart_and_torn_save(lm_data, tmp_path, ARGS, ("-model_part-0", "-model_part-1"))
    replicated = assert_replicated_across_parts([ref_dir / f"checkpoint_last-model_part-{k}.pt" for k in (0, 1)])
    assert any("layer_norm" in key for key in replicated), replicated
    assert any(key.endswith("out_proj.bias") for key in replicated), replicated
    assert any(key.endswith("fc2.bias") for key in replicated), replicated


ONE_STACK_ARGS = [*ARGS[:ARGS.index("--model-parallel-size")], "--decoder-layers", "4", "--update-freq", "2"]
PIPELINE_ARGS = [*ONE_STACK_ARGS, "--pipeline-model-parallel-size", "2"]


def test_pipeline_sigkill_then_restart_is_exact(lm_data, tmp_path):
    refused = {}

    def another_split_or_one_process(ref_dir: Path) -> list:
        """Another split, or one process, on copies of the uninterrupted run's stages (to fail),
        each in a save dir of its own: a run that wrongly trained would overwrite only its copies,
        not the stages the test reads afterwards."""
        def refuse_on_a_copy(name: str, args: list, world_size: int) -> None:
            save_dir = tmp_path / f"{name}_save"
            save_dir.mkdir()
            stages = sorted(ref_dir.glob("checkpoint_last-stage*.pt"))
            assert len(stages) == 2, stages
            for stage in stages:
                shutil.copy(stage, save_dir)
            refused[name] = fairseq_ranks("fairseq-train", [str(lm_data), "--save-dir", str(save_dir), *args],
                                          world_size, tmp_path / f"{name}_logs")

        refuse_on_a_copy("split", [*PIPELINE_ARGS, "--pipeline-layers", "1,3"], 2)
        refuse_on_a_copy("one", ONE_STACK_ARGS, 1)
        return list(refused.values())

    ref_dir = _sigkill_restart_and_torn_save(lm_data, tmp_path, PIPELINE_ARGS, ("-stage0", "-stage1"),
                                             another_split_or_one_process)
    first, last = (torch.load(ref_dir / f"checkpoint_last-stage{p}.pt", weights_only=True) for p in (0, 1))
    assert torch.equal(first["model"]["decoder.embed.embed_tokens.weight"], last["model"]["decoder.tied_output.weight"])
    moments = [s["last_optimizer_state"]["state"][s["extra_state"]["ts_tensor_parallel"]["params"].index(name)]
               for s, name in ((first, "decoder.embed.embed_tokens.weight"), (last, "decoder.tied_output.weight"))]
    assert all(torch.equal(moments[0][key], moments[1][key]) for key in ("exp_avg", "exp_avg_sq"))
    assert sorted(k.split(".")[2] for k in first["model"] if k.endswith("final_layer_norm.weight")) == ["0", "1"]
    assert sorted(k.split(".")[2] for k in last["model"] if k.endswith("final_layer_norm.weight")) == ["2", "3"]

    # another split, or one process, on these stages: one line naming the conversion
    for (_, logs), expected_lines in (
            (refused["split"], ("holds decoder.layers.{0-1} but this model (pipeline stage) holds decoder.layers.{0}:",
                                "holds decoder.layers.{2-3} but this model (pipeline stage) holds decoder.layers.{1-3}:")),
            (refused["one"], ("was saved as 1 tensor-parallel part(s) x 2 pipeline stage(s)",))):
        for log, expected in zip(logs, expected_lines):
            lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
            assert expected in lines[-1] and "Traceback" not in log.read_text(), log.read_text()[-2000:]


def wait_failing(procs: list, logs: list[Path]) -> list[Path]:
    """Wait for runs that must all exit with an error (within the timeout); their logs."""
    for p, log in zip(procs, logs):
        assert p.wait(timeout=300) != 0, log.read_text()[-2000:]
    return logs
