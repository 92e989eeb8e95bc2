"""Model level, through the fairseq console tools (one process per rank, gloo):

- ``ts_lm`` and ``ts_transformer`` (label-smoothed, with accuracy): the per-update
  losses and grad norms of the first 4 updates (``ts_transformer``: 20) at
  ``--model-parallel-size 2`` equal the single-process run within 1e-4 relative (dropout 0);
- the same two at ``--model-parallel-size 2 --sequence-parallel`` (translation batches of
  odd lengths are padded to the group size); with dropout on, every replicated tensor is
  bitwise identical in the two parts after 4 updates; the X-MoE ``ts_lm`` below with
  ``--sequence-parallel`` at TP = 2 equals 1 process;
- DP x TP = 2 x 2 on 4 processes (the X-MoE local-scope run with ``--checkpoint-activations``)
  equals the single process accumulating the same two
  batches per update (``--update-freq 2``, which is what 2-way data parallelism sums);
- ``ts_mlm`` (``masked_lm``) at size 2 equals size 1;
- Magneto X-MoE ``ts_lm`` with SparseClip and the router z-loss (4 experts over the 2
  data-parallel ranks, ``local`` balance-loss scope) on 4 processes (TP = 2 x DP = 2): per-update
  loss, ``gnorm``, ``gnorm_dense``, ``gnorm_expert``, balance loss and z-loss equal 1 process with ``--update-freq 2``
  and TP = 1 x DP = 2 (``global`` scope: equals TP = 1 x DP = 2), and every replicated
  tensor (routers included) is bitwise equal in the two tensor-parallel parts; the same
  for ``ts_transformer`` with ``moe_label_smoothed_cross_entropy --report-accuracy``
  against 1 process;
- ``ts-reshard`` 2 -> 1 -> 2 gives back identical parts (weights and Adam moments), and
  the size-1 checkpoint scores like the size-2 parts (``fairseq-eval-lm``);
- ``fairseq-generate`` at size 2 equals size 1 on the resharded checkpoint;
- loading parts at another size (also from inside a distributed run), or asking for
  N > 1 without processes, is a one-line error.

Every process start costs seconds on the shared CPU, so the runs of each phase are
launched together.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.helpers.mp_helpers import (
    BIN,
    USER_DIR,
    assert_replicated_across_parts,
    launch,
    make_corpora,
    relative_close,
    run_jobs,
    train_records,
)
from torchscale_fairseq.cli import reshard

UPDATES = 4  # update 1: the forward and gradients; 2-4: Adam's steps (moments and bias correction)
MT_UPDATES = 20  # mt1 and mt2: mt2's checkpoint is what fairseq-generate decodes (inside the first epoch)
REL = 1e-4
COMMON = ["--optimizer", "adam", "--lr", "1e-3", "--clip-norm", "0.5", "--dropout", "0", "--log-format", "json",
          "--log-interval", "1", "--no-epoch-checkpoints", "--ddp-backend", "legacy_ddp", "--seed", "3"]


def lm_args(data: Path, save: Path, tp: int, updates: int = UPDATES, update_freq: int = 2) -> list[str]:
    return [str(data), "--task", "language_modeling", "--arch", "ts_lm_tiny", "--decoder-layers", "2",
            "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4",
            "--tokens-per-sample", "32", "--batch-size", "4", "--max-update", str(updates), "--save-dir", str(save),
            "--update-freq", str(update_freq), "--model-parallel-size", str(tp), *COMMON]


def mt_args(data: Path, save: Path, tp: int, updates: int = UPDATES) -> list[str]:
    return [str(data), "--task", "translation", "--arch", "ts_transformer_tiny", "--encoder-layers", "2",
            "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
            "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4",
            "--decoder-attention-heads", "4", "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--report-accuracy", "--max-tokens", "300", "--max-update", str(updates),
            "--save-dir", str(save), "--model-parallel-size", str(tp), *COMMON]


def mlm_args(data: Path, save: Path, tp: int) -> list[str]:
    return [str(data), "--task", "masked_lm", "--criterion", "masked_lm", "--arch", "ts_mlm_tiny", "--encoder-layers", "2",
            "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4",
            "--tokens-per-sample", "32", "--sample-break-mode", "none", "--batch-size", "4", "--max-update",
            str(UPDATES), "--save-dir", str(save), "--model-parallel-size", str(tp), "--disable-validation", *COMMON]


# X-MoE (Magneto's default backbone, xmoe router) with SparseClip; "all" keeps both experts
# of every token, so routing draws nothing from the generator that update-freq would advance
MOE = ["--moe-expert-count", "4", "--moe-freq", "2", "--moe-second-expert-policy", "all", "--optimizer", "sparse_clip",
       "--sparse-clip-base", "adam", "--clip-norm", "0.5", "--disable-validation", "--moe-z-loss-wt", "0.001"]


def moe_lm_args(data: Path, save: Path, tp: int, update_freq: int, scope: str = "local") -> list[str]:
    return [*lm_args(data, save, tp, UPDATES, update_freq), *MOE, "--criterion", "moe_cross_entropy",
            "--moe-balance-scope", scope]


def moe_mt_args(data: Path, save: Path, tp: int, update_freq: int) -> list[str]:
    return [*mt_args(data, save, tp), "--update-freq", str(update_freq), *MOE,
            "--criterion", "moe_label_smoothed_cross_entropy", "--moe-balance-scope", "local"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Data, then every training run at once: LM, MT and MLM at N = 1 and 2, dense and X-MoE DP x TP
    with their references."""
    root = tmp_path_factory.mktemp("tp")
    lm_bin, mt_bin = make_corpora(root)
    jobs = {
        "lm1": (lm_args(lm_bin, root / "lm1", 1), 1),
        "lm2": (lm_args(lm_bin, root / "lm2", 2), 2),
        "mt1": (mt_args(mt_bin, root / "mt1", 1, MT_UPDATES), 1),
        "mt2": (mt_args(mt_bin, root / "mt2", 2, MT_UPDATES), 2),
        "dptp": (lm_args(lm_bin, root / "dptp", 2, update_freq=1), 4),
        "lm2sp": ([*lm_args(lm_bin, root / "lm2sp", 2), "--sequence-parallel"], 2),
        "mt2sp": ([*mt_args(mt_bin, root / "mt2sp", 2), "--sequence-parallel"], 2),
        "lm2sp_dropout": ([*lm_args(lm_bin, root / "lm2sp_dropout", 2), "--sequence-parallel",
                           "--dropout", "0.1", "--attention-dropout", "0.1"], 2),
        "mlm1": (mlm_args(lm_bin, root / "mlm1", 1), 1),
        "mlm2": (mlm_args(lm_bin, root / "mlm2", 2), 2),
        "moe1": (moe_lm_args(lm_bin, root / "moe1", 1, update_freq=2), 1),
        "moe_dp2": (moe_lm_args(lm_bin, root / "moe_dp2", 1, update_freq=1), 2),
        "moe2sp": ([*moe_lm_args(lm_bin, root / "moe2sp", 2, update_freq=2), "--sequence-parallel"], 2),
        # local scope with recomputation; the global-scope pair below runs TP x DP without it
        "moe_tp2dp2": ([*moe_lm_args(lm_bin, root / "moe_tp2dp2", 2, update_freq=1), "--checkpoint-activations"], 4),
        "moe_dp2_global": (moe_lm_args(lm_bin, root / "moe_dp2_global", 1, update_freq=1, scope="global"), 2),
        "moe_tp2dp2_global": (moe_lm_args(lm_bin, root / "moe_tp2dp2_global", 2, update_freq=1, scope="global"), 4),
        "mtmoe1": (moe_mt_args(mt_bin, root / "mtmoe1", 1, update_freq=2), 1),
        "mtmoe_tp2dp2": (moe_mt_args(mt_bin, root / "mtmoe_tp2dp2", 2, update_freq=1), 4),
    }
    logs, _ = run_jobs({name: ("fairseq-train", args, world) for name, (args, world) in jobs.items()}, root,
                       unrounded=True)
    return {"root": root, "lm_bin": lm_bin, "mt_bin": mt_bin, "logs": logs}


def _eval_lm_args(data: Path, path: Path) -> list[str]:
    return [str(data), "--path", str(path), "--task", "language_modeling", "--tokens-per-sample", "32",
            "--batch-size", "4", "--gen-subset", "valid"]


@pytest.fixture(scope="module")
def evaluations(runs, tmp_path_factory) -> dict:
    """Reshard (in this process), then every evaluation and error run at once."""
    root = tmp_path_factory.mktemp("eval")
    lm_parts, mt_parts = runs["root"] / "lm2" / "checkpoint_last.pt", runs["root"] / "mt2" / "checkpoint_last.pt"
    lm_one, lm_two = root / "lm_one" / "checkpoint.pt", root / "lm_two" / "checkpoint.pt"
    mt_one = root / "mt_one" / "checkpoint.pt"
    for args in ((lm_parts, 1, lm_one), (lm_one, 2, lm_two), (mt_parts, 1, mt_one)):
        reshard.main(["--input", str(args[0]), "--size", str(args[1]), "--output", str(args[2])])
    gen = [str(runs["mt_bin"]), "--beam", "4", "--nbest", "4", "--batch-size", "8", "--gen-subset", "test"]
    jobs = {
        "eval2": ("fairseq-eval-lm", [*_eval_lm_args(runs["lm_bin"], lm_parts), "--model-parallel-size", "2"], 2),
        "eval1": ("fairseq-eval-lm", _eval_lm_args(runs["lm_bin"], lm_one), 1),
        "gen2": ("fairseq-generate", [*gen, "--path", str(mt_parts), "--model-parallel-size", "2"], 2),
        "gen1": ("fairseq-generate", [*gen, "--path", str(mt_one)], 1),
        "size_mismatch": ("fairseq-eval-lm", [*_eval_lm_args(runs["lm_bin"], lm_one), "--model-parallel-size", "2"],
                          2),
    }
    errors = {
        "parts_base": [str(BIN / "fairseq-eval-lm"), *_eval_lm_args(runs["lm_bin"], lm_parts)],
        "part_file": [str(BIN / "fairseq-eval-lm"),
                      *_eval_lm_args(runs["lm_bin"], lm_parts.with_name("checkpoint_last-model_part-0.pt"))],
        "no_processes": [str(BIN / "fairseq-train"), *lm_args(runs["lm_bin"], root / "np", 2, 1)],
    }
    error_procs = {name: launch([*cmd, "--user-dir", str(USER_DIR), "--cpu"], root / f"{name}.log")
                   for name, cmd in errors.items()}
    logs, job_codes = run_jobs(jobs, root, must_fail=["size_mismatch"])
    codes = {name: p.wait(timeout=600) for name, p in error_procs.items()}
    codes["size_mismatch"] = job_codes["size_mismatch"]
    error_logs = {name: root / f"{name}.log" for name in errors}
    error_logs["size_mismatch"] = logs["size_mismatch"][0]
    return {"logs": logs, "lm_parts": lm_parts, "lm_two": lm_two, "codes": codes, "error_logs": error_logs}


def assert_same_trajectory(log1: Path, log2: Path, keys: tuple[str, ...], updates: int = UPDATES) -> None:
    r1, r2 = train_records(log1)[:updates], train_records(log2)
    assert len(r1) == len(r2) == updates, (len(r1), len(r2))
    for step, (a, b) in enumerate(zip(r1, r2), start=1):
        for key in keys:
            x, y = float(a[key]), float(b[key])
            assert relative_close(x, y, REL), f"update {step} {key}: {x} vs {y}"


def test_lm_losses_and_gnorm_equal_single_process(runs):
    assert_same_trajectory(runs["logs"]["lm1"][0], runs["logs"]["lm2"][0], keys=("loss", "gnorm"))


def test_sequence_parallel_lm_equals_single_process(runs):
    assert_same_trajectory(runs["logs"]["lm1"][0], runs["logs"]["lm2sp"][0], keys=("loss", "gnorm"))


def test_sequence_parallel_transformer_equals_single_process(runs):
    assert_same_trajectory(runs["logs"]["mt1"][0], runs["logs"]["mt2sp"][0],
                           keys=("loss", "nll_loss", "gnorm", "accuracy"))


def test_sequence_parallel_keeps_replicated_tensors_identical_with_dropout(runs):
    """Each rank draws its own dropout masks on its slice of the sequence, and the
    replicated parameters' gradients are summed over the group: after 4 updates every
    replicated tensor (LayerNorms, row-parallel biases) and its Adam moments are bitwise
    equal in both parts."""
    replicated = assert_replicated_across_parts(
        [runs["root"] / "lm2sp_dropout" / f"checkpoint_last-model_part-{k}.pt" for k in (0, 1)])
    assert any("layer_norm" in name for name in replicated) and any("out_proj.bias" in name for name in replicated)


def test_transformer_losses_and_gnorm_equal_single_process(runs):
    assert_same_trajectory(runs["logs"]["mt1"][0], runs["logs"]["mt2"][0],
                           keys=("loss", "nll_loss", "gnorm", "accuracy"), updates=MT_UPDATES)


def test_data_times_tensor_parallel_on_four_processes(runs):
    assert_same_trajectory(runs["logs"]["lm1"][0], runs["logs"]["dptp"][0], keys=("loss", "gnorm"))
    assert sorted(p.name for p in (runs["root"] / "dptp").glob("checkpoint_last*.pt")) == [
        "checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"]


def test_mlm_losses_and_gnorm_equal_single_process(runs):
    assert_same_trajectory(runs["logs"]["mlm1"][0], runs["logs"]["mlm2"][0], keys=("loss", "gnorm"))


MOE_KEYS = ("loss", "gnorm", "gnorm_dense", "gnorm_expert", "moe_gate_loss", "moe_z_loss")


@pytest.mark.parametrize("reference", ["moe1", "moe_dp2"])
def test_moe_sparse_clip_tensor_times_data_parallel_with_activation_checkpointing(runs, reference):
    """TP = 2 x DP = 2 (experts over the data-parallel ranks), recomputing every layer in
    backward (routing, all-to-alls and tensor-parallel collectives repeated), against 1 process
    with ``--update-freq 2`` and against TP = 1 x DP = 2, neither recomputing."""
    logs = runs["logs"]
    assert_same_trajectory(logs[reference][0], logs["moe_tp2dp2"][0], keys=MOE_KEYS)
    records = train_records(logs["moe_tp2dp2"][0])
    assert all(float(r["gnorm_expert"]) > 0 for r in records)
    assert any(float(r["gnorm"]) > 0.5 for r in records), "SparseClip must clip at least once"


def test_moe_sequence_parallel_equals_single_process(runs):
    """X-MoE at TP = 2 with ``--sequence-parallel`` (the MoE layers gather the sequence,
    route the same tokens as one process and keep their slice) against 1 process."""
    logs = runs["logs"]
    assert_same_trajectory(logs["moe1"][0], logs["moe2sp"][0], keys=MOE_KEYS)
    assert all(float(r["gnorm_expert"]) > 0 for r in train_records(logs["moe2sp"][0]))


def test_moe_global_balance_scope_tensor_times_data_parallel(runs):
    """``--moe-balance-scope global`` (expert counts summed over the data-parallel group, not
    over the tensor-parallel ranks holding the same tokens): TP = 2 x DP = 2 equals TP = 1 x DP = 2,
    and differs from the local scope (so the comparison sees the scope at all)."""
    logs = runs["logs"]
    assert_same_trajectory(logs["moe_dp2_global"][0], logs["moe_tp2dp2_global"][0], keys=MOE_KEYS)
    first = [float(train_records(logs[name][0])[0]["moe_gate_loss"]) for name in ("moe_tp2dp2", "moe_tp2dp2_global")]
    assert not relative_close(*first, 1e-4), first


def test_moe_tensor_parallel_parts_share_replicated_tensors(runs):
    """Routers, LayerNorms, row-parallel biases: bitwise equal on both tensor-parallel ranks
    of each data-parallel rank (each its own expert shard)."""
    save = runs["root"] / "moe_tp2dp2"
    for shard in (0, 1):
        replicated = assert_replicated_across_parts(
            [save / f"checkpoint_last-model_part-{k}-shard{shard}.pt" for k in (0, 1)])
        assert any(".router." in key for key in replicated), replicated


def test_moe_transformer_tensor_times_data_parallel_with_accuracy(runs):
    assert_same_trajectory(runs["logs"]["mtmoe1"][0], runs["logs"]["mtmoe_tp2dp2"][0],
                           keys=("loss", "nll_loss", "accuracy", *MOE_KEYS[1:]))


def test_one_checkpoint_part_per_tensor_parallel_rank(runs):
    names = sorted(p.name for p in (runs["root"] / "lm2").glob("checkpoint_last*.pt"))
    assert names == ["checkpoint_last-model_part-0.pt", "checkpoint_last-model_part-1.pt"]
    state = torch.load(runs["root"] / "lm2" / "checkpoint_last-model_part-1.pt", weights_only=True)
    recorded = state["extra_state"]["ts_tensor_parallel"]
    assert recorded["size"] == 2 and recorded["rng"], "RNG tracker state missing from the checkpoint"
    assert state["cfg"]["common"]["model_parallel_size"] == 2


def test_reshard_round_trip_gives_identical_parts(evaluations):
    parts, two = evaluations["lm_parts"], evaluations["lm_two"]
    for k in range(2):
        a = torch.load(parts.with_name(f"checkpoint_last-model_part-{k}.pt"), weights_only=True)
        b = torch.load(two.with_name(f"checkpoint-model_part-{k}.pt"), weights_only=True)
        assert a["model"].keys() == b["model"].keys()
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), key
        moments_a, moments_b = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
        assert moments_a.keys() == moments_b.keys()
        for index, entry in moments_a.items():
            for name, value in entry.items():
                same = torch.equal(value, moments_b[index][name]) if torch.is_tensor(value) else (
                    value == moments_b[index][name])
                assert same, (index, name)


def test_eval_lm_at_size_two_equals_resharded_size_one(evaluations):
    pattern = re.compile(r"Loss \(base 2\): ([0-9.]+)")
    logs = evaluations["logs"]
    loss2, loss1 = (float(pattern.findall(log.read_text())[-1]) for log in (logs["eval2"][0], logs["eval1"][0]))
    assert abs(loss2 - loss1) <= 1e-4, (loss2, loss1)


def hypotheses(log: Path) -> dict[str, list[tuple[float, str, list[float]]]]:
    """``{H-id: [(score, text, positional scores), ...]}`` in n-best order."""
    out: dict[str, list] = {}
    for line in log.read_text().splitlines():
        if line.startswith("H-"):
            key, score, text = line.split("\t")
            out.setdefault(key, []).append((float(score), text, []))
        elif line.startswith("P-"):
            key, scores = line.split("\t")
            out["H-" + key[2:]][-1][2].extend(float(x) for x in scores.split())
    return out


def test_generate_tensor_parallel_equals_single_process(evaluations):
    logs = evaluations["logs"]
    h2, h1 = hypotheses(logs["gen2"][0]), hypotheses(logs["gen1"][0])
    assert len(h1) >= 8 and h2.keys() == h1.keys()
    for key in h1:
        assert len(h1[key]) == len(h2[key]) == 4, key
        for (s2, t2, p2), (s1, t1, p1) in zip(h2[key], h1[key]):
            assert t2 == t1, key
            assert abs(s2 - s1) <= 1e-4, key
            assert len(p2) == len(p1) and all(abs(a - b) <= 1e-4 for a, b in zip(p2, p1)), key
    assert hypotheses(logs["gen2"][1]) == {}, "only tensor-parallel rank 0 writes hypotheses"


@pytest.mark.parametrize("case,needle", [
    ("parts_base", "ts-reshard"), ("part_file", "ts-reshard"), ("no_processes", "needs a multi-process run"),
    ("size_mismatch", "ts-reshard"),
])
def test_one_line_errors(evaluations, case, needle):
    text = evaluations["error_logs"][case].read_text()
    assert evaluations["codes"][case] == 2, text[-2000:]
    assert "Traceback" not in text
    last = text.strip().splitlines()[-1]
    assert needle in last and last.count("error:") == 1, last
