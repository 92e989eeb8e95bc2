"""``--optimizer ts_adamw`` (:mod:`torchscale_fairseq.optim.adamw`) against independent
references: fairseq's own ``Adam`` (``fairseq.optim.adam.Adam``, what ``--optimizer adam``
runs on the CPU) and a float64 AdamW written out here, for each ``--adamw-impl``; then
through ``fairseq-train`` on a tiny ``ts_lm``, against ``--optimizer adam`` in fp32 and in
each precision wrapper, inside SparseClip, resumed from a checkpoint and under
``--zero-sharding os``.

Tolerances: 1e-6 relative for a few steps on fp32 tensors (fp32 rounding, ~1e-7 per step);
the one real difference from fairseq's Adam, where ``eps`` enters (module docstring), is
shown with a large ``eps``; at the default ``eps`` on unit-scale gradients it is ~1e-7.
Through ``fairseq-train`` (unrounded logs, 6 significant digits): fp32 losses within 1e-5;
the 16-bit modes within fp16's 1e-3 and bf16's 3e-3 of ``adam`` in the same mode (as
``test_mixed_precision.py``); resumed and ZeRO-sharded runs equal as logged.
"""

from __future__ import annotations

import io
import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from fairseq.optim import build_optimizer
from fairseq.optim.adam import Adam, FairseqAdamConfig
from omegaconf import OmegaConf

from tests.helpers.cli_utils import LM_TRAIN, WORKERS, run_many
from tests.helpers.mp_helpers import UNROUNDED, USER_DIR, dist_flags, launch, train_records, wait_all
from tests.helpers.rendezvous import rendezvous_url
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.optim.adamw import TsAdamW, TsAdamWConfig, choose_impl

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.98), 1e-8, 0.1
SHAPES = [(7, 5), (13,), (3, 4, 2)]
STEPS = 5
IMPLS = ["fused", "foreach", "for-loop"]


def _ts_adamw(params: list[torch.Tensor], impl: str | None = None, eps: float = EPS, **flags) -> TsAdamW:
    """``ts_adamw`` built as fairseq builds it: from its registry, on a DictConfig."""
    cfg = OmegaConf.create({"_name": "ts_adamw", "lr": [LR], "adam_betas": str(BETAS), "adam_eps": eps,
                            "weight_decay": WD, "adamw_impl": impl, **flags})
    return build_optimizer(cfg, params)


def _problem(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Unit-scale parameters and ``STEPS`` gradients per parameter."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    grads = [[torch.randn(s, generator=g).to(dtype) for _ in range(STEPS)] for s in SHAPES]
    return params, grads


def _run(optimizer: torch.optim.Optimizer | TsAdamW, params: list[torch.Tensor], grads, steps=range(STEPS)) -> None:
    for t in steps:
        for p, gs in zip(params, grads):
            p.grad = gs[t].clone()
        optimizer.step()


def _copies(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.clone()) for p in params]


def adamw_float64(params, grads, eps: float, fairseq_eps: bool = False) -> list[torch.Tensor]:
    """AdamW by hand in float64 (Loshchilov & Hutter, decoupled weight decay, bias-corrected
    moments); ``fairseq_eps``: ``eps`` added before the bias correction of ``v``, as fairseq's Adam."""
    (beta1, beta2), out = BETAS, []
    for p, gs in zip(params, grads):
        p, m, v = p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
        for t, g in enumerate(gs, start=1):
            g = g.double()
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            p = p - LR * WD * p
            bc1, bc2 = 1 - beta1**t, 1 - beta2**t
            if fairseq_eps:
                p = p - LR * math.sqrt(bc2) / bc1 * m / (v.sqrt() + eps)
            else:
                p = p - LR / bc1 * m / ((v / bc2).sqrt() + eps)
        out.append(p)
    return out


def _max_rel_diff(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in zip(got, ref))


@pytest.mark.parametrize("impl", IMPLS)
def test_steps_equal_fairseq_adam_and_the_formula(impl):
    params, grads = _problem()
    ts, fs = _copies(params), _copies(params)
    optimizer = _ts_adamw(ts, impl)
    assert optimizer.optimizer.defaults["fused"] is (impl == "fused")
    assert optimizer.optimizer.defaults["foreach"] is (impl == "foreach")
    _run(optimizer, ts, grads)
    _run(Adam(fs, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), fs, grads)
    assert _max_rel_diff(ts, fs) < 1e-6
    assert _max_rel_diff(ts, adamw_float64(params, grads, EPS)) < 1e-6
    assert _max_rel_diff(fs, adamw_float64(params, grads, EPS, fairseq_eps=True)) < 1e-6


def test_the_one_difference_from_fairseq_adam_is_where_eps_enters():
    eps = 1e-2
    params, grads = _problem()
    ts, fs = _copies(params), _copies(params)
    _run(_ts_adamw(ts, eps=eps), ts, grads)
    _run(Adam(fs, lr=LR, betas=BETAS, eps=eps, weight_decay=WD), fs, grads)
    assert _max_rel_diff(ts, adamw_float64(params, grads, eps)) < 1e-6
    assert _max_rel_diff(fs, adamw_float64(params, grads, eps, fairseq_eps=True)) < 1e-6
    assert _max_rel_diff(ts, fs) > 1e-4


def test_defaults_and_flags_are_adams():
    ours, adams = TsAdamWConfig(), FairseqAdamConfig()
    for name in ("adam_betas", "adam_eps", "weight_decay"):
        assert getattr(ours, name) == getattr(adams, name), name
    flags = {"lr": [LR], "adam_betas": str(BETAS), "adam_eps": EPS, "weight_decay": WD}
    adam = build_optimizer(OmegaConf.create({"_name": "adam", "tpu": False, **flags}), _copies(_problem()[0]))
    assert _ts_adamw(_copies(_problem()[0])).optimizer_config == adam.optimizer_config


def test_memory_efficient_bf16_keeps_bfloat16_moments():
    """bfloat16 parameters (``--memory-efficient-bf16``): fairseq's Adam keeps fp32 moments,
    ts_adamw bfloat16 ones; both round the parameters to bfloat16 after every step, and the
    fused kernel computes in fp32, so the parameters agree to about one bfloat16 step."""
    params, grads = _problem(torch.bfloat16)
    ts, fs = _copies(params), _copies(params)
    optimizer, adam = _ts_adamw(ts), Adam(fs, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    _run(optimizer, ts, grads)
    _run(adam, fs, grads)
    for p, q in zip(ts, fs):
        assert p.dtype == q.dtype == torch.bfloat16
        assert {k: v.dtype for k, v in optimizer.optimizer.state[p].items()} == {
            "step": torch.float32, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
        assert adam.state[q]["exp_avg"].dtype == adam.state[q]["exp_avg_sq"].dtype == torch.float32
    assert _max_rel_diff(ts, fs) < 2 ** -7
    assert _max_rel_diff(ts, adamw_float64(params, grads, EPS)) < 2 ** -6


def test_float16_parameters_are_refused():
    params = _copies(_problem(torch.float16)[0])
    with pytest.raises(TsConfigError, match="float16 moments underflow: use --fp16 or --memory-efficient-bf16"):
        _ts_adamw(params)


def test_fused_falls_back_to_foreach_in_one_log_line_or_is_refused_when_forced(caplog):
    """Parameters of a device torch has no fused AdamW for (``meta``)."""
    params = [torch.nn.Parameter(torch.zeros(3, device="meta"))]
    with caplog.at_level(logging.INFO, logger="torchscale_fairseq.optim.adamw"):
        optimizer = _ts_adamw(params)
    assert optimizer.optimizer.defaults["foreach"] and not optimizer.optimizer.defaults["fused"]
    lines = [r.getMessage() for r in caplog.records if r.name == "torchscale_fairseq.optim.adamw"]
    assert len(lines) == 1 and "AdamW foreach" in lines[0] and "refuses" in lines[0] and "meta" in lines[0], lines
    with pytest.raises(TsConfigError, match="--adamw-impl fused: torch's fused AdamW refuses .*meta.*: use --adamw-impl "
                                            "foreach or drop the flag"):
        _ts_adamw(params, "fused")
    assert choose_impl("for-loop", params) == ("for-loop", "--adamw-impl for-loop")


@pytest.mark.parametrize("flags, message", [
    ({"adam_betas": "(0.9, 1.5)"}, r"--adam-betas \(0.9, 1.5\) must be two numbers in \[0, 1\)"),
    ({"adam_betas": "(0.9,)"}, r"--adam-betas \(0.9,\) must be two numbers"),
    ({"adam_betas": "0.9 0.98"}, "--adam-betas '0.9 0.98' is not a pair of numbers: write it as '\\(0.9, 0.98\\)'"),
    ({"adam_eps": -1.0}, "--adam-eps -1.0 must be >= 0"),
    ({"weight_decay": -0.1}, "--weight-decay -0.1 must be >= 0"),
    ({"lr": [-1.0]}, "--lr -1.0 must be >= 0"),
])
def test_bad_hyper_parameters_are_one_line(flags, message):
    with pytest.raises(TsConfigError, match=message):
        _ts_adamw(_copies(_problem()[0]), **flags)


def _saved(state_dict: dict) -> bytes:
    """``state_dict`` as a checkpoint file holds it (``torch.load`` it once per loader: loading
    keeps the loaded tensors where their dtype and device are right, they are not copied)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getvalue()


def test_state_dict_round_trip_continues_and_keeps_this_runs_impl():
    params, grads = _problem()
    ref = _copies(params)
    optimizer = _ts_adamw(ref, "fused")
    _run(optimizer, ref, grads, range(3))
    saved = _saved(optimizer.state_dict())
    resumed = {impl: _copies([p.detach() for p in ref]) for impl in IMPLS}
    for impl, ps in resumed.items():
        other = _ts_adamw(ps, impl)
        other.load_state_dict(torch.load(io.BytesIO(saved), weights_only=True))
        assert all(g["fused"] is (impl == "fused") and g["foreach"] is (impl == "foreach") for g in other.param_groups)
        _run(other, ps, grads, range(3, STEPS))
    _run(optimizer, ref, grads, range(3, STEPS))
    assert all(torch.equal(a, b) for a, b in zip(resumed["fused"], ref))
    assert _max_rel_diff(resumed["foreach"], ref) < 1e-6 and _max_rel_diff(resumed["for-loop"], ref) < 1e-6


# --- through fairseq-train ---------------------------------------------------------------

UPDATES = 4
TINY = ["--arch", "ts_lm_tiny", "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "2", "--dropout", "0", "--log-interval", "1", "--disable-validation",
        "--num-workers", "0"]
MODES = {"fp32": [], "bf16": ["--bf16"], "memory_efficient_bf16": ["--memory-efficient-bf16"], "fp16": ["--fp16"]}
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-3, "memory_efficient_bf16": 3e-3, "fp16": 1e-3}
RESUMED = ["fp32", "memory_efficient_bf16"]
SPARSE_CLIP = ["--optimizer", "sparse_clip", "--clip-norm", "0.5", "--sparse-clip-base"]


def _train_args(data: Path, save: Path, *flags: str, updates: int = UPDATES) -> list[str]:
    """``fairseq-train``'s arguments for the tiny LM (``LM_TRAIN``, whose ``--optimizer adam``
    ``flags`` override), saving in ``save``: 16 sequences an update as two batches of 8
    (``--update-freq 2``), what two data-parallel ranks of 8 see (``test_zero_sharding_...``)."""
    return [str(data), "--user-dir", str(USER_DIR), *LM_TRAIN, *TINY, "--batch-size", "8", "--update-freq", "2",
            "--max-update", str(updates), "--save-dir", str(save), *flags]


def _losses(log: Path) -> dict[int, float]:
    return {int(r["num_updates"]): float(r["loss"]) for r in train_records(log)}


@pytest.fixture(scope="module")
def runs(lm_data, tmp_path_factory) -> dict:
    """Every single-process run of this module (two at a time), logs in ``root/NAME.log``,
    checkpoints in ``root/NAME``: ``adam`` and ``ts_adamw`` in each mode (``ts_adamw`` in the
    ``RESUMED`` modes also saving at update 2), inside SparseClip, and a refused one; then the
    ``RESUMED`` runs, from those update-2 checkpoints."""
    root = tmp_path_factory.mktemp("adamw")
    runs = {f"{opt}_{mode}": ["--optimizer", opt, *flags] for mode, flags in MODES.items()
            for opt in ("adam", "ts_adamw")}
    for mode in RESUMED:
        runs[f"ts_adamw_{mode}"] += ["--save-interval-updates", "2"]
    runs.update({"sparse_clip_adam": [*SPARSE_CLIP, "adam"],
                 "sparse_clip_ts_adamw": [*SPARSE_CLIP, "ts_adamw", "--adamw-impl", "foreach"],
                 "memory_efficient_fp16": ["--optimizer", "ts_adamw", "--memory-efficient-fp16"]})
    runs.update({f"resumed_{mode}": ["--optimizer", "ts_adamw", *MODES[mode], "--restore-file",
                                     str(root / f"ts_adamw_{mode}" / "checkpoint_1_2.pt")] for mode in RESUMED})

    def start(names: list[str]) -> None:
        procs = run_many([[sys.executable, str(UNROUNDED), "fairseq-train", *_train_args(lm_data, root / name, *runs[name])]
                          for name in names], check=False)
        for name, proc in zip(names, procs):
            (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
            assert proc.returncode == (2 if name == "memory_efficient_fp16" else 0), proc.stderr[-3000:]

    resumed = [f"resumed_{mode}" for mode in RESUMED]
    start([name for name in runs if name not in resumed])
    start(resumed)
    return {"root": root}


@pytest.mark.parametrize("mode", list(MODES))
def test_same_losses_as_adam(runs, mode):
    ref, got = _losses(runs["root"] / f"adam_{mode}.log"), _losses(runs["root"] / f"ts_adamw_{mode}.log")
    assert sorted(got) == sorted(ref) == list(range(1, UPDATES + 1))
    for update, loss in ref.items():
        assert got[update] == pytest.approx(loss, rel=LOSS_TOLERANCE[mode]), (update, ref, got)
    log = (runs["root"] / f"ts_adamw_{mode}.log").read_text()
    dtype = "bfloat16" if mode == "memory_efficient_bf16" else "float32"
    tensors = "1 tensors" if mode == "fp16" else "tensors"  # --fp16: the flat fp32 master
    assert "ts_adamw: torch.optim.AdamW fused on" in log and f"{tensors} (cpu {dtype}): the default" in log


def test_inside_sparse_clip(runs):
    ref, got = _losses(runs["root"] / "sparse_clip_adam.log"), _losses(runs["root"] / "sparse_clip_ts_adamw.log")
    assert sorted(got) == list(range(1, UPDATES + 1))
    assert all(got[u] == pytest.approx(ref[u], rel=1e-5) for u in ref), (ref, got)
    assert "AdamW foreach on" in (runs["root"] / "sparse_clip_ts_adamw.log").read_text()


@pytest.mark.parametrize("mode", RESUMED)
def test_resume_continues_as_the_uninterrupted_run(runs, mode):
    """Restarted from the update-2 checkpoint of the run of 4: its updates 3 and 4.
    ``--memory-efficient-bf16``: the checkpoint holds the bfloat16 moments as fp32 (fairseq's
    ``move_to_cpu``), loading casts them back (fairseq's restore of the saved dtypes is off)."""
    uninterrupted, second = _losses(runs["root"] / f"ts_adamw_{mode}.log"), runs["root"] / f"resumed_{mode}.log"
    assert "Loaded checkpoint" in second.read_text() and "@ 2 updates" in second.read_text()
    assert sorted(_losses(second)) == [3, 4] and sorted(uninterrupted) == [1, 2, 3, 4]
    assert _losses(second) == {u: uninterrupted[u] for u in (3, 4)}


def test_memory_efficient_fp16_is_refused_in_one_line(runs):
    lines = (runs["root"] / "memory_efficient_fp16.log").read_text().strip().splitlines()
    assert lines[-1].endswith(" error: --optimizer ts_adamw keeps its moments in the parameters' dtype and float16 "
                              "moments underflow: use --fp16 or --memory-efficient-bf16 instead of "
                              "--memory-efficient-fp16, or --optimizer adam"), lines[-1]
    assert "Traceback" not in "\n".join(lines)


def _moment_numel(state: dict) -> int:
    """Elements of an optimizer state's tensors of rank >= 1 (Adam's two moments)."""
    return sum(v.numel() for fields in state.values() for v in fields.values() if torch.is_tensor(v) and v.dim() > 0)


def test_zero_sharding_equals_unsharded(runs, lm_data, tmp_path):
    """Two data-parallel ranks of 8 sequences with ``--zero-sharding os`` against the one
    process accumulating the same two batches (``ts_adamw_fp32``): the same losses as logged,
    and each rank holds moments for part of the parameters, together all of them (the
    unsharded run's checkpoint)."""
    url = rendezvous_url(tmp_path)
    args = _train_args(lm_data, tmp_path / "save", "--optimizer", "ts_adamw", "--update-freq", "1", "--no-save",
                       "--zero-sharding", "os")
    logs = [tmp_path / f"{rank}.log" for rank in range(2)]
    wait_all([launch([sys.executable, str(WORKERS / "zero_cli.py"), "0", *args, *dist_flags(2, rank, url)], log)
              for rank, log in enumerate(logs)], logs)
    ref = _losses(runs["root"] / "ts_adamw_fp32.log")
    assert _losses(logs[0]) == ref and len(ref) == UPDATES
    dense = [json.loads([line for line in log.read_text().splitlines() if line.startswith("optimizer-state ")][-1]
                        .split(" ", 1)[1])["dense"] for log in logs]
    saved = torch.load(runs["root"] / "ts_adamw_fp32" / "checkpoint_last.pt", weights_only=True)
    total = _moment_numel(saved["last_optimizer_state"]["state"])
    assert dense[0] + dense[1] == total and 0 < dense[0] < total
