"""Expert parallelism on 2 gloo processes: equivalence with 1 process on the same global
batch, and end-to-end ``fairseq-train`` -> ``ts-consolidate-experts`` -> single-process
``fairseq-validate`` / ``fairseq-eval-lm`` / ``fairseq-generate``."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.cli_utils import (
    LM_TRAIN,
    MT_TRAIN,
    USER_DIR,
    json_logs,
    run,
    run_many,
    tool,
)
from tests.helpers.mp_helpers import run_fairseq
from tests.helpers.rendezvous import rendezvous_url

TINY_LM = ["--arch", "ts_lm_tiny", "--decoder-layers", "2", "--decoder-embed-dim", "32",
           "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2"]
MOE = ["--moe-expert-count", "4", "--moe-freq", "2"]


def _train_two_ranks(args: list, out) -> str:
    """``fairseq-train`` on 2 gloo ranks, one process each (torchrun itself: tests/integration/test_data_parallel.py);
    rank 0's output."""
    return run_fairseq("fairseq-train", [*args, "--num-workers", "0"], 2, out)[0].read_text()


def _consolidate(name, out):
    run([sys.executable, "-m", "torchscale_fairseq.cli.consolidate_experts", name, "-o", out])


# Expert parallelism that must train as one process: no capacity drops, no random second expert,
# SGD (see below), and the balance loss of the whole batch (``local``, the default, is that of each
# rank's half: a different loss, as test_local_balance_scope_equals_update_freq shows).
EXPERT_PARALLEL_EQUIVALENCE = ["--moe-freq", "1", "--criterion", "moe_cross_entropy", "--moe-capacity-factor", "0",
                               "--moe-second-expert-policy", "all", "--clip-norm", "0.5", "--optimizer", "sparse_clip",
                               "--sparse-clip-base", "sgd", "--lr", "0.5", "--moe-balance-scope", "global"]
# 4 experts, top-2, the balance loss weighted 1 (large enough that its scope changes the run):
# ``global`` on 2 ranks is both the expert-parallel run compared with 1 process and the run
# the local scope must differ from, so the two tests share it
TOP2 = ["--moe-expert-count", "4", *EXPERT_PARALLEL_EQUIVALENCE, "--moe-top-k", "2", "--moe-gate-loss-wt", "1.0"]
HARNESS_RUNS = {  # name: (world, dist_harness flags)
    "top2_one": ("1", TOP2),
    "top2_global2": ("2", TOP2),
    "top2_local2": ("2", [*TOP2, "--moe-balance-scope", "local"]),
    "top2_local_freq2": ("1", [*TOP2, "--moe-balance-scope", "local", "--update-freq", "2"]),
    "replica_one": ("1", ["--moe-expert-count", "1", *EXPERT_PARALLEL_EQUIVALENCE, "--moe-top-k", "1"]),
    "replica2": ("2", ["--moe-expert-count", "1", *EXPERT_PARALLEL_EQUIVALENCE, "--moe-top-k", "1"]),
}


@pytest.fixture(scope="module")
def harness(lm_data, tmp_path_factory):
    """``harness(*names)``: the saved results of those :data:`HARNESS_RUNS` (each run once per
    module; the missing ones started together)."""
    root, done = tmp_path_factory.mktemp("harness"), {}

    def results(*names: str) -> list[dict]:
        missing = [name for name in names if name not in done]
        run_many([[sys.executable, "-m", "tests.workers.dist_harness", root / f"{name}.pt", HARNESS_RUNS[name][0],
                   lm_data, *HARNESS_RUNS[name][1]] for name in missing])
        done.update({name: torch.load(root / f"{name}.pt") for name in missing})
        return [done[name] for name in names]

    return results


@pytest.mark.parametrize("one,two", [("top2_one", "top2_global2"), ("replica_one", "replica2")])
def test_expert_parallel_equals_single_process(harness, one, two):
    """E=4 on 2 ranks (2 experts each) and E=1 on 2 ranks (replicas) vs 1 process with the
    whole batch (``--moe-balance-scope global``: the balance loss of the whole batch): same
    losses, same SparseClip norms (issue 4: expert-parallel and data-parallel norm), same
    parameters.

    SGD, not Adam: Adam divides by sqrt(v), so gradients that are mathematically zero
    (the attention key bias) turn float summation-order noise into lr-sized steps."""
    one, two = harness(one, two)
    assert one["losses"] == pytest.approx(two["losses"], abs=1e-5)
    assert one["losses"][0] != one["losses"][-1]
    assert one["norms"] == pytest.approx(two["norms"], rel=1e-5)
    assert one["norms"][0] > 0.5, "clipping must fire at least once"
    assert one["state"].keys() == two["state"].keys()
    for name, p in one["state"].items():
        assert p.shape == two["state"][name].shape, name
        assert torch.allclose(p, two["state"][name], atol=1e-5, rtol=0), name


def test_expert_parallel_size_2_inside_4_data_parallel_ranks_equals_update_freq_4(tmp_path, lm_data):
    """``--moe-expert-parallel-size 2`` on 4 data-parallel ranks: 4 experts over 2 all-to-all groups
    of 2 ranks (2 experts each), replicated across the groups; with SparseClip it trains as 1
    process with ``--update-freq 4`` (the local balance scope: each micro-batch's own loss), the
    same losses, clipped norms (each expert counted once) and parameters."""
    flags = ["--moe-expert-count", "4", "--moe-freq", "1", "--criterion", "moe_cross_entropy",
             "--moe-capacity-factor", "0", "--moe-second-expert-policy", "all", "--clip-norm", "0.5",
             "--optimizer", "sparse_clip", "--sparse-clip-base", "sgd", "--lr", "0.5"]
    runs = {"ep2dp4": ("4", ["--moe-expert-parallel-size", "2"]), "freq4": ("1", ["--update-freq", "4"])}
    run_many([[sys.executable, "-m", "tests.workers.dist_harness", tmp_path / f"{name}.pt", world, lm_data, *flags,
               *extra] for name, (world, extra) in runs.items()])
    four, one = (torch.load(tmp_path / f"{name}.pt") for name in runs)
    assert four["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert four["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert one["norms"][0] > 0.5, "clipping must fire at least once"
    for name, p in one["state"].items():
        assert p.shape == four["state"][name].shape, name
        assert torch.allclose(p, four["state"][name], atol=1e-5, rtol=0), name


def test_replicated_experts_save_consolidate_and_export(tmp_path, lm_data):
    """``--moe-expert-parallel-size 1`` on 2 ranks: every rank holds all 4 experts (replicas) and
    saves its shard; ``ts-consolidate-experts`` and ``ts-export-hf`` read the layout from the
    shards, and the consolidated model equals each shard's experts."""
    save = tmp_path / "ck"
    _train_two_ranks([lm_data, *LM_TRAIN, *TINY_LM, *MOE, "--moe-expert-parallel-size", "1", "--criterion",
                      "moe_cross_entropy", "--max-update", "4", "--save-dir", save, "--disable-validation"], tmp_path)
    shards = [torch.load(save / f"checkpoint_last-shard{r}.pt", weights_only=False) for r in range(2)]
    _consolidate(save / "checkpoint_last.pt", tmp_path / "lm.pt")
    merged = torch.load(tmp_path / "lm.pt", weights_only=False)["model"]
    experts = [k for k in merged if ".experts." in k]
    assert experts and all(merged[k].size(0) == 4 for k in experts)
    for k in experts:
        assert torch.equal(shards[0]["model"][k], merged[k]) and torch.equal(shards[1]["model"][k], merged[k]), k
    pytest.importorskip("transformers", reason="needs the export extra: pip install -e .[export]")
    run([sys.executable, "-m", "torchscale_fairseq.cli.export_hf", save / "checkpoint_last.pt", tmp_path / "hf"])
    assert (tmp_path / "hf" / "config.json").exists()


def test_balance_scope_against_its_definition(tmp_path):
    """Each rank's balance loss (both scopes) against the formula computed by hand."""
    run([sys.executable, "-m", "tests.workers.balance_scope_worker", rendezvous_url(tmp_path)], timeout=120)


def test_local_balance_scope_equals_update_freq(harness):
    """``--moe-balance-scope local`` on 2 ranks trains as 1 process with ``--update-freq 2``
    on the same micro-batches (fairseq's MoE branch and TorchScale); ``global`` on 2 ranks
    does not (its balance loss is that of the two micro-batches together)."""
    out = dict(zip(("local2", "global2", "freq2"), harness("top2_local2", "top2_global2", "top2_local_freq2")))
    gate = {name: [log["moe_gate_loss"] for log in o["logged"]] for name, o in out.items()}
    assert gate["local2"] == pytest.approx(gate["freq2"], abs=1e-4)
    assert out["local2"]["losses"] == pytest.approx(out["freq2"]["losses"], abs=1e-5)
    assert out["local2"]["norms"] == pytest.approx(out["freq2"]["norms"], rel=1e-5)
    for name, p in out["freq2"]["state"].items():
        assert torch.allclose(p, out["local2"]["state"][name], atol=1e-5, rtol=0), name
    assert abs(gate["global2"][0] - gate["freq2"][0]) > 1e-3, gate


def test_fine_grained_shared_and_aux_free_bias_on_two_ranks_equal_update_freq(tmp_path, lm_data):
    """Top-4 of 8 narrower experts, a shared expert and auxiliary-loss-free biases on 2 ranks (experts
    split over them) train as 1 process with ``--update-freq 2``: the bias update counts the loads of
    both ranks' micro-batches, so the biases are equal on the 2 ranks and to the single process's."""
    flags = ["--moe-expert-count", "8", "--moe-freq", "1", "--moe-top-k", "4", "--moe-expert-ffn-dim", "16",
             "--moe-shared-expert-count", "1", "--moe-router-bias-update-rate", "0.05", "--criterion",
             "moe_cross_entropy", "--moe-capacity-factor", "0", "--moe-gate-loss-wt", "0", "--optimizer", "sgd",
             "--lr", "0.5"]
    runs = {"two": ("2", []), "freq2": ("1", ["--update-freq", "2"])}
    run_many([[sys.executable, "-m", "tests.workers.dist_harness", tmp_path / f"{name}.pt", world, lm_data, *flags,
               *extra] for name, (world, extra) in runs.items()])
    two, one = (torch.load(tmp_path / f"{name}.pt") for name in runs)
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert two["bias_spread"] == 0.0
    biases = [name for name in one["state"] if name.endswith(".expert_bias")]
    assert biases and all(bool(one["state"][name].abs().sum() > 0) for name in biases)
    for name, p in one["state"].items():
        assert torch.allclose(p, two["state"][name], atol=1e-5, rtol=0), name


def test_lm_train_consolidate_validate_eval(tmp_path, lm_data):
    save = tmp_path / "ck"
    log = _train_two_ranks([lm_data, *LM_TRAIN, *TINY_LM, *MOE, "--criterion", "moe_cross_entropy", "--max-update",
                            "5", "--save-dir", save], tmp_path)
    inner = json_logs(log, "train_inner")
    assert inner and {"moe_gate_loss", "moe_cv_dec1", "moe_drop", "moe_entropy"} <= set(inner[-1])
    valid = json_logs(log, "valid")[-1]
    assert sorted(p.name for p in save.iterdir()) == [
        "checkpoint_best-shard0.pt", "checkpoint_best-shard1.pt", "checkpoint_last-shard0.pt",
        "checkpoint_last-shard1.pt"]
    _consolidate(save / "checkpoint_last.pt", tmp_path / "lm.pt")
    out, ev, same = run_many([
        [tool("fairseq-validate"), lm_data, "--user-dir", USER_DIR, "--path", tmp_path / "lm.pt", "--task",
         "language_modeling", "--tokens-per-sample", "32", "--batch-size", "16", "--cpu", "--num-workers", "0"],
        [tool("fairseq-eval-lm"), lm_data, "--user-dir", USER_DIR, "--path", tmp_path / "lm.pt",
         "--tokens-per-sample", "32", "--batch-size", "16", "--cpu", "--num-workers", "0"],
        [sys.executable, "-m", "torchscale_fairseq.cli.consolidate_experts", save / "checkpoint_last-shard0.pt",
         save / "checkpoint_last-shard0.pt", "-o", tmp_path / "bad.pt"],
    ], check=False)
    assert out.returncode == 0 and ev.returncode == 0, out.stderr[-2000:] + ev.stderr[-2000:]
    line = [ln for ln in out.stderr.splitlines() + out.stdout.splitlines() if "valid on 'valid'" in ln][-1]
    fields = dict(part.strip().split(" ", 1) for part in line.split("|")[3:])
    assert float(fields["loss"]) == pytest.approx(float(valid["valid_loss"]), abs=2e-3)
    # routing statistics are per-batch averages: two ranks see the batches one process sees,
    # split between them (the last one partial), so they agree to a few percent, not exactly
    for key in ("moe_gate_loss", "moe_cv_dec1", "moe_entropy"):
        assert float(fields[key]) == pytest.approx(float(valid[f"valid_{key}"]), rel=0.05), key
    assert "Perplexity" in ev.stdout + ev.stderr
    assert same.returncode == 2
    assert same.stderr.strip().splitlines()[-1].endswith("are both rank 0: shards from different runs")


def test_translation_train_consolidate_generate(tmp_path, mt_data):
    save = tmp_path / "ck"
    _train_two_ranks([mt_data, *MT_TRAIN, "--arch", "ts_transformer_tiny", "--encoder-layers", "2",
                      "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
                      "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads",
                      "2", "--decoder-attention-heads", "2", *MOE, "--criterion", "moe_label_smoothed_cross_entropy",
                      "--max-update", "10", "--save-dir", save, "--disable-validation"], tmp_path)
    _consolidate(save / "checkpoint_last.pt", tmp_path / "mt.pt")
    gen = run([tool("fairseq-generate"), mt_data, "--user-dir", USER_DIR, "--path", tmp_path / "mt.pt",
               "--beam", "2", "--max-len-b", "20", "--batch-size", "16", "--cpu", "--num-workers", "0"])
    text = gen.stdout + gen.stderr
    assert sum(1 for ln in text.splitlines() if ln.startswith("H-")) == 40
    assert "BLEU" in text


def test_uneven_token_counts_do_not_hang(tmp_path):
    """Rank 0 routes 6 tokens, rank 1 22; then rank 1 has only padding (0 tokens)."""
    run([sys.executable, "-m", "tests.workers.uneven_worker", rendezvous_url(tmp_path)], timeout=120)
