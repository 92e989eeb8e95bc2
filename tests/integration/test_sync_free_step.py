"""``--ts-sync-free-step``: the training step's two host reads of the gradient norm (the plugin's
skip test and fairseq's ``isfinite`` test) are gone; the fused AdamW kernel skips a non-finite
update on the device (``found_inf``), the update is counted, and the skips are read every
``--log-interval`` updates. References: the same model trained by the synced step (updates equal),
the sync counter of ``benchmarks/step_overhead.py`` on the synced step, and torch's own skip
semantics (parameters unchanged at the injected update)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from fairseq.logging import metrics
from omegaconf import OmegaConf

from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, WORKERS, last_error_line, run, tool
from tests.helpers.mp_helpers import dist_flags, launch, relative_close, train_records, wait_all
from tests.helpers.rendezvous import rendezvous_url
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.integration.host_overhead import DeviceSkips, check_sync_free_step, fused_adam

sys.path.insert(0, str(WORKERS.parent.parent / "benchmarks"))
import step_overhead as so  # noqa: E402

TINY = "--arch ts_lm --decoder-layers 1 --decoder-embed-dim 32 --decoder-attention-heads 2 --decoder-ffn-embed-dim 64"
SYNC_FREE = ["--optimizer", "ts_adamw", "--ts-sync-free-step"]
TRAIN = [*LM_TRAIN, "--arch", "ts_lm_tiny", "--disable-validation", "--log-interval", "1", "--no-save"]


def _sites(run: so.Run) -> list[str]:
    device = so.DeviceTensors()
    so.warm_up(run, device, 2)
    _, syncs = so.count(run, device)
    return sorted(site.split(" ")[0].rsplit(":", 1)[0] for (_, site), n in syncs.sites.items() for _ in range(n))


def test_the_step_reads_the_norm_nowhere_and_updates_as_the_synced_step():
    """The same model, seed and batch, fp32 with --clip-norm (fires at 0.05): three updates of the
    synced step and of the sync-free one leave bitwise equal parameters; the synced step's two host
    reads are the norm tests (ours and fairseq's; the clip and the decoder's padding layout are
    decided on the device and on the host), the sync-free step has none."""
    common = f"{TINY} --optimizer ts_adamw --dropout 0 --clip-norm 0.05"
    synced = so.fairseq_run("synced", common, 40, (4, 16))
    free = so.fairseq_run("free", f"{common} --ts-sync-free-step", 40, (4, 16), synced.sample)
    assert [n for n, _ in synced.model.named_parameters()] == [n for n, _ in free.model.named_parameters()]
    synced_sites, free_sites = _sites(synced), _sites(free)  # two updates each, then a counted one
    assert synced_sites == ["fairseq/trainer.py", "torchscale_fairseq/integration/trainer.py"]
    assert free_sites == []
    assert metrics.get_smoothed_values("train_inner")["clip"] == 100  # every update of both clipped
    for a, b in zip(synced.model.parameters(), free.model.parameters()):
        assert torch.equal(a, b)


def _steps(output: str) -> list[dict]:
    """The ``STEP`` records ``inject_nonfinite.py`` prints."""
    return [json.loads(line[5:]) for line in output.splitlines() if line.startswith("STEP ")]


def test_a_nonfinite_update_is_skipped_on_the_device_and_counted(lm_data, tmp_path):
    proc = run([sys.executable, WORKERS / "inject_nonfinite.py", "2", lm_data, "--user-dir", USER_DIR, "--save-dir",
                tmp_path, "--max-update", "4", *TRAIN, *SYNC_FREE])
    steps = _steps(proc.stdout)
    injected = [s for s in steps if s["injected"]]
    assert len(injected) == 1 and len(steps) == 4
    (upd_b, sum_b, _, state_b, _), (upd_a, sum_a, _, state_a, _) = injected[0]["before"], injected[0]["after"]
    assert upd_a == upd_b + 1 and sum_a == sum_b and state_a == state_b  # counted; no parameter, moment or step
    assert all(s["after"][0] == s["before"][0] + 1 for s in steps)
    assert all(s["after"][1] != s["before"][1] for s in steps[1:] if not s["injected"])  # (update 1: lr 0)
    out = proc.stdout + proc.stderr
    assert "1 update(s) before update 3 had a non-finite gradient norm and were skipped on the device" in out
    assert "gradient overflow detected" not in out
    gnorms = [json.loads(line[line.index("{"):])["gnorm"] for line in out.splitlines() if "train_inner" in line]
    assert gnorms[2] == "nan" and all(g != "nan" for i, g in enumerate(gnorms) if i != 2)  # the skipped update's


@pytest.mark.parametrize("reported_at", ["save", "validation"])
def test_the_device_skip_composes_with_bf16_sparse_clip_and_router_bias(lm_data, tmp_path, reported_at):
    """--bf16 (the wrapper's fp32 masters), SparseClip around the fused AdamW (its two-part clip)
    and MoE layers balanced by expert biases (moved after each update, on the device): at the
    injected update nothing moves - parameters, masters' moments and step counts, expert biases -
    and the update is counted; every other update moves the parameters and the biases. No report
    falls due (--log-interval 10): the skip is reported by the checkpoint saved at the end (no
    validation), or by the validation at the end (--no-save), before validation's own lines."""
    moe = ["--decoder-layers", "2", "--moe-expert-count", "4", "--moe-freq", "2", "--criterion", "moe_cross_entropy",
           "--moe-router-bias-update-rate", "0.01"]
    only = ["--disable-validation"] if reported_at == "save" else ["--no-save"]
    proc = run([sys.executable, WORKERS / "inject_nonfinite.py", "2", lm_data, "--user-dir", USER_DIR, "--save-dir",
                tmp_path, "--max-update", "4", *LM_TRAIN, "--arch", "ts_lm_tiny", *only,
                "--log-interval", "10", *moe, "--bf16", "--optimizer", "sparse_clip",
                "--sparse-clip-base", "ts_adamw", "--clip-norm", "0.5", "--ts-sync-free-step"])
    steps = _steps(proc.stdout)
    assert [s["injected"] for s in steps] == [False, False, True, False]
    for s in steps:
        (upd_b, sum_b, _, state_b, bias_b), (upd_a, sum_a, _, state_a, bias_a) = s["before"], s["after"]
        assert upd_a == upd_b + 1
        if s["injected"]:
            assert (sum_a, state_a, bias_a) == (sum_b, state_b, bias_b)
        else:
            assert state_a != state_b and bias_a != bias_b
            assert s["call"] == 0 or sum_a != sum_b  # (update 1: lr 0)
    out = proc.stdout + proc.stderr
    note = "1 update(s) before update 4 had a non-finite gradient norm and were skipped on the device"
    assert out.count(note) == 1
    if reported_at == "validation":
        assert out.index(note) < out.index('begin validation on "valid" subset')


def test_a_nonfinite_gradient_on_one_pipeline_stage_skips_the_update_on_every_stage(lm_data, tmp_path):
    """P = 2 (1F1B over 2 micro-batches, tied embeddings): a NaN in stage 0's embedding gradient at
    update 3 makes the norm, summed over the stages, non-finite on both; neither stage's parameters
    or optimizer state move and both count the update; rank 0 reports the skip, and every update's
    loss and finite norm equal one process given the same NaN (1e-5 relative, as the pipeline tests)."""
    inject = [sys.executable, str(WORKERS / "inject_nonfinite.py"), "2@0", str(lm_data), "--user-dir", str(USER_DIR)]
    args = [*TRAIN, *SYNC_FREE, "--max-update", "4", "--decoder-layers", "4", "--update-freq", "2", "--dropout", "0",
            "--ddp-backend", "legacy_ddp"]
    init_method = rendezvous_url(tmp_path / "pp")
    logs = [tmp_path / "pp" / f"rank{r}.log" for r in range(2)] + [tmp_path / "one.log"]
    procs = [launch([*inject, "--save-dir", str(tmp_path / "pp"), *args, "--pipeline-model-parallel-size", "2",
                     *dist_flags(2, r, init_method)], logs[r]) for r in range(2)]
    procs.append(launch([*inject, "--save-dir", str(tmp_path / "one"), *args], logs[2]))
    wait_all(procs, logs)
    for log in logs:
        steps = _steps(log.read_text())
        assert [s["after"][0] for s in steps] == [1, 2, 3, 4]
        for s in steps:
            moved = (s["before"][1], s["before"][3]) != (s["after"][1], s["after"][3])
            assert moved == (s["call"] != 2), (log.name, s)  # (update 1: lr 0 moves the moments only)
        text = log.read_text()
        assert "gradient overflow detected" not in text
        if log != logs[1]:  # (fairseq logs INFO on rank 0 only)
            assert "1 update(s) before update 3 had a non-finite gradient norm and were skipped on the device" in text
    pipelined, one = train_records(logs[0]), train_records(logs[2])
    assert len(pipelined) == len(one) == 4 and pipelined[2]["gnorm"] == one[2]["gnorm"] == "nan"
    for update, (a, b) in enumerate(zip(pipelined, one), start=1):
        for key in ("loss",) if update == 3 else ("loss", "gnorm"):
            assert relative_close(float(a[key]), float(b[key]), 1e-5), f"update {update} {key}: {a[key]} vs {b[key]}"


def test_skips_in_a_row_stop_training_at_the_next_report(lm_data, tmp_path):
    """Every update from the second on is non-finite: with --max-skipped-updates 3 and a report
    every 2 updates, the report at update 4 (updates 2-4 skipped, a run begun before the report at
    update 2) stops training in one line."""
    proc = run([sys.executable, WORKERS / "inject_nonfinite.py", "1+", lm_data, "--user-dir", USER_DIR,
                "--save-dir", tmp_path, "--max-update", "20", *TRAIN, *SYNC_FREE, "--max-skipped-updates", "3",
                "--log-interval", "2"], check=False)
    assert proc.returncode != 0  # (the worker runs fairseq's cli_main, not the plugin's one-line console entry)
    assert last_error_line(proc).endswith(
        "3 updates in a row skipped for a non-finite gradient norm (after update 4): lower --lr, add warm-up or "
        "--clip-norm, check the data, or raise --max-skipped-updates")
    assert [s["after"][0] for s in _steps(proc.stdout)] == [1, 2, 3]  # the fourth call's report raised


def test_the_refusals_name_the_flag(lm_data, tmp_path):
    proc = run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--save-dir", tmp_path, *TRAIN,
                "--max-update", "1", "--ts-sync-free-step"], check=False)  # LM_TRAIN's --optimizer adam
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--ts-sync-free-step skips a non-finite update inside torch's fused Adam kernel" in last_error_line(proc)
    assert "--optimizer ts_adamw" in last_error_line(proc)

    def cfg(**common):
        return OmegaConf.create({"common": {"fp16": False, "memory_efficient_fp16": False, "amp": False, **common},
                                 "distributed_training": {"zero_sharding": "none"}})

    check_sync_free_step(cfg(bf16=True))
    for flag in ("fp16", "memory_efficient_fp16", "amp"):
        with pytest.raises(TsConfigError, match="fp16's loss scaler reads every update's overflow on the host"):
            check_sync_free_step(cfg(**{flag: True}))
    sharded = cfg()
    sharded.distributed_training.zero_sharding = "os"
    with pytest.raises(TsConfigError, match="--zero-sharding os is not supported yet"):
        check_sync_free_step(sharded)
    p = torch.nn.Parameter(torch.ones(2))
    for impl in (dict(foreach=True), dict(fused=False, foreach=False)):
        with pytest.raises(TsConfigError, match="AdamW"):
            fused_adam(type("Fairseq", (), {"optimizer": torch.optim.AdamW([p], **impl)})())


def test_device_skips_count_runs_across_reports():
    """The counts against a host tally: skips since the last report, the longest run among them
    (a run crossing a report continues), and ``found_inf`` set for each update."""
    p = torch.nn.Parameter(torch.ones(2))
    skips = DeviceSkips(torch.optim.AdamW([p], fused=True))
    assert skips.report() == (0, 0)
    norms = [1.0, float("nan"), float("inf"), 2.0, float("nan"), float("nan")]
    applied = [float(skips.mark(torch.tensor(n))) for n in norms[:4]]
    assert applied == [1.0, 0.0, 0.0, 1.0] and float(skips.optimizer.found_inf) == 0.0
    assert skips.report() == (2, 2)
    for n in norms[4:]:
        skips.mark(torch.tensor(n))
    assert skips.report() == (2, 2)
    skips.mark(torch.tensor(float("nan")))
    assert skips.report() == (1, 3) and float(skips.optimizer.found_inf) == 1.0
