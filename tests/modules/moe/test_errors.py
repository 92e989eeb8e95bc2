"""Bad input gives one-line :class:`TsConfigError` s before training starts."""

from __future__ import annotations

import subprocess
from argparse import Namespace

import pytest
import torch

from tests.helpers.cli_utils import LM_TRAIN, MT_TRAIN, USER_DIR, last_error_line, run, tool
from tests.helpers.mp_helpers import fairseq_ranks
from torchscale_fairseq.cli.consolidate_experts import consolidate
from torchscale_fairseq.criterions.balance_check import check_balance_loss_criterion
from torchscale_fairseq.criterions.moe_terms import moe_outputs
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.expert_parallel import expert_layout
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext
from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig, moe_config_from_args
from torchscale_fairseq.modules.moe.layer import EXPERT_CHOICE_DECODING, MoELayer, check_generation


def _args(**kw) -> Namespace:
    base = {"moe_expert_count": 4, "moe_freq": 2, "moe_top_k": 2, "moe_router": "xmoe"}
    base.update(kw)
    return Namespace(**base)


def test_expert_count_incompatible_with_world_size():
    assert expert_layout(4, 8) == (4, 2)
    assert expert_layout(8, 4) == (4, 1)
    with pytest.raises(TsConfigError, match="not compatible with 4 data-parallel ranks"):
        expert_layout(4, 6)


def test_expert_parallel_size_layout_and_errors():
    """``--moe-expert-parallel-size A``: all-to-all groups of ``A`` ranks, ``E / A`` experts each."""
    assert expert_layout(4, 8, 2) == (2, 4)
    assert expert_layout(8, 4, 4) == (4, 1)
    assert expert_layout(4, 6, 1) == (1, 6)
    with pytest.raises(TsConfigError, match=r"^--moe-expert-parallel-size 3 does not divide the 4 data-parallel"):
        expert_layout(4, 6, 3)
    with pytest.raises(TsConfigError, match=r"^--moe-expert-parallel-size 4 does not divide --moe-expert-count 6"):
        expert_layout(8, 6, 4)
    with pytest.raises(TsConfigError, match=r"^--moe-expert-parallel-size -1 is negative"):
        expert_layout(4, 8, -1)
    with pytest.raises(TsConfigError, match=r"^--moe-expert-parallel-size 2 does not divide the 1 data-parallel"):
        ParallelContext.single_process().expert_parallel(4, 2)  # one process


@pytest.mark.parametrize("kw,match", [
    ({"moe_top_k": 2, "moe_expert_count": 1}, "larger than --moe-expert-count"),
    ({"moe_freq": 0}, "--moe-freq 0 must be positive"),
    ({"moe_freq": -1}, "--moe-freq -1 must be positive"),
    ({"moe_expert_count": -2}, "negative"),
    ({"moe_checkpoint_exchange": "twice"}, "--moe-checkpoint-exchange 'twice' is unknown: choose one of repeat, keep"),
    ({"moe_capacity_factor": -1.0}, r"--moe-capacity-factor -1.0 is negative: use 0 \(no dropping\)"),
    ({"moe_eval_capacity_factor": -0.5}, r"--moe-eval-capacity-factor -0.5 is negative: use 0 \(no dropping\)"),
])
def test_flag_errors(kw, match):
    with pytest.raises(TsConfigError, match=match):
        moe_config_from_args(_args(**kw))


def test_moe_criterion_needs_moe_aware_model():
    with pytest.raises(TsConfigError, match="MoE-aware"):
        moe_outputs(torch.nn.Linear(2, 2)(torch.ones(1, 2)), "moe_cross_entropy")


def _shard(rank: int, updates: int = 5, dense: float = 0.0) -> dict:
    return {
        "cfg": {"model": {"moe_expert_count": 4, "_name": "ts_lm"},
                "distributed_training": {"distributed_rank": rank, "distributed_world_size": 2}},
        "optimizer_history": [{"num_updates": updates}],
        "model": {"decoder.w": torch.full((2,), dense),
                  "decoder.layers.1.ffn.experts.fc1_weight": torch.full((2, 3), float(rank))},
    }


def test_consolidation_merges_and_refuses_mismatched_shards():
    merged = consolidate([_shard(1), _shard(0)], ["s1", "s0"])
    assert merged["model"]["decoder.layers.1.ffn.experts.fc1_weight"][:, 0].tolist() == [0, 0, 1, 1]
    assert merged["cfg"]["distributed_training"]["distributed_world_size"] == 1
    with pytest.raises(TsConfigError, match="different runs or steps"):
        consolidate([_shard(0), _shard(1, updates=6)], ["a", "b"])
    with pytest.raises(TsConfigError, match="dense weight decoder.w: shards from different runs"):
        consolidate([_shard(0), _shard(1, dense=1.0)], ["a", "b"])
    with pytest.raises(TsConfigError, match="both rank 0"):
        consolidate([_shard(0), _shard(0)], ["a", "b"])
    with pytest.raises(TsConfigError, match="one of 2 shards but 1 were given"):
        consolidate([_shard(0)], ["a"])


def test_cli_prints_one_line(tmp_path, lm_data):
    proc = run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--task", "language_modeling",
                "--arch", "ts_lm_tiny", "--cpu", "--moe-expert-count", "16", "--moe-top-k", "9",
                "--optimizer", "adam", "--max-tokens", "256", "--save-dir", tmp_path], check=False)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert errors == ["fairseq-train: error: --moe-top-k 9 is not supported: use 1 to 8"], proc.stderr[-2000:]


def _tiny_lm(lm_data, router: str):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [str(lm_data), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_tiny", "--cpu",
            "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2",
            "--tokens-per-sample", "16", "--moe-expert-count", "2", "--moe-top-k", "1", "--moe-router", router]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    return task, task.build_model(cfg.model), cfg


def test_generator_is_refused_for_expert_choice_models(lm_data):
    """Raised when fairseq builds the sequence generator, before any decoder call; scoring
    (``--score-reference``) and token-choice routers are let through."""
    task, model, cfg = _tiny_lm(lm_data, "expert_choice")
    with pytest.raises(TsConfigError, match="cannot serve autoregressive"):
        task.build_generator([model], cfg.generation)
    task.build_generator([model], Namespace(score_reference=True))
    task, model, cfg = _tiny_lm(lm_data, "xmoe")
    task.build_generator([model], cfg.generation)
    check_generation([torch.nn.Sequential(MoELayer(MoEConfig(expert_count=2, top_k=1, router="xmoe"), FFNSpec(8, 16)))])


def test_generate_refuses_expert_choice_before_decoding(tmp_path, mt_data):
    """The error comes from building the generator: no source or hypothesis line is printed."""
    save = tmp_path / "ck"
    run([tool("fairseq-train"), mt_data, "--user-dir", USER_DIR, *MT_TRAIN, "--arch", "ts_transformer_tiny",
         "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--moe-expert-count", "2", "--moe-router", "expert_choice",
         "--criterion", "moe_label_smoothed_cross_entropy", "--max-update", "1", "--save-dir", save,
         "--disable-validation", "--num-workers", "0"])
    gen = run([tool("fairseq-generate"), mt_data, "--user-dir", USER_DIR, "--path", save / "checkpoint_last.pt",
               "--beam", "2", "--max-len-b", "20", "--batch-size", "16", "--cpu", "--num-workers", "0"], check=False)
    assert gen.returncode == 2
    assert not [ln for ln in gen.stdout.splitlines() if ln[:2] in ("S-", "H-", "D-", "P-")]
    errors = [ln for ln in gen.stderr.splitlines() if "error" in ln.lower()]
    assert errors == [f"fairseq-generate: error: {EXPERT_CHOICE_DECODING}"], gen.stderr[-2000:]


class _Criterion(torch.nn.Module):
    pass


class _MoECriterion(torch.nn.Module):
    adds_moe_balance_loss = True


@pytest.mark.parametrize("name,suggested", [
    ("cross_entropy", "use --criterion moe_cross_entropy ("),
    ("label_smoothed_cross_entropy", "use --criterion moe_label_smoothed_cross_entropy ("),
    ("masked_lm", "use --criterion moe_masked_lm ("),
    ("adaptive_loss", "moe_cross_entropy or moe_label_smoothed_cross_entropy or moe_masked_lm"),
])
def test_moe_model_with_a_criterion_without_balance_loss(name, suggested):
    model = torch.nn.Sequential(MoELayer(MoEConfig(expert_count=4), FFNSpec(8, 16)))
    with pytest.raises(TsConfigError, match="without their balance loss") as err:
        check_balance_loss_criterion(model, _Criterion(), name, Namespace())
    assert suggested in str(err.value) and "--moe-allow-no-balance-loss" in str(err.value)
    check_balance_loss_criterion(model, _Criterion(), name, Namespace(moe_allow_no_balance_loss=True))
    check_balance_loss_criterion(model, _MoECriterion(), "moe_cross_entropy", Namespace())
    choice = torch.nn.Sequential(MoELayer(MoEConfig(expert_count=2, top_k=1, router="expert_choice"), FFNSpec(8, 16)))
    check_balance_loss_criterion(choice, _Criterion(), name, Namespace())
    check_balance_loss_criterion(torch.nn.Linear(2, 2), _Criterion(), name, Namespace())


def test_plain_criterion_trains_an_moe_model_when_asked(tmp_path, lm_data):
    """The refusal itself is a case of the bad-input matrix (tests/helpers/bad_inputs.py)."""
    run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", *LM_TRAIN,
         "--moe-expert-count", "2", "--moe-allow-no-balance-loss", "--max-update", "1", "--save-dir", tmp_path,
         "--disable-validation", "--num-workers", "0"])
    assert (tmp_path / "checkpoint_last.pt").exists()


TINY_LM = ["--arch", "ts_lm_tiny", "--decoder-layers", "2", "--decoder-embed-dim", "32",
           "--decoder-attention-heads", "2", "--criterion", "moe_cross_entropy", "--max-update", "1",
           "--num-workers", "0"]


LAYOUT_ERRORS = {
    "expert_count": (["--moe-expert-count", "3", "--decoder-ffn-embed-dim", "64"],
                     "--moe-expert-count 3 is not compatible with 2 data-parallel ranks"),
    "ffn_width": (["--moe-expert-count", "2", "--decoder-ffn-embed-dim", "63", "--model-parallel-size", "2",
                   "--ddp-backend", "legacy_ddp"], "FFN dimension (63) is not divisible by --model-parallel-size 2"),
}


@pytest.fixture(scope="module")
def layout_runs(lm_data, tmp_path_factory) -> dict:
    """Both cases' 2 ranks, started together (one round of processes): ``{case: (save dir, [(exit code, log)])}``."""
    root = tmp_path_factory.mktemp("layout")
    started = {name: fairseq_ranks("fairseq-train", [str(lm_data), *LM_TRAIN, *TINY_LM, *flags, "--save-dir",
                                                     str(root / name / "ck")], 2, root / name)
               for name, (flags, _) in LAYOUT_ERRORS.items()}
    return {name: (root / name / "ck", [(proc.wait(timeout=300), log.read_text()) for proc, log in zip(*ranks)])
            for name, ranks in started.items()}


@pytest.mark.parametrize("case", LAYOUT_ERRORS)
def test_two_rank_layout_errors_are_one_line(layout_runs, case):
    """Expert count against the data-parallel ranks and FFN width against the tensor-parallel
    size: both ranks stop at model construction with one line, nothing written."""
    save, ranks = layout_runs[case]
    for code, log in ranks:
        assert code == 2, log[-2000:]
        assert "Traceback" not in log, log[-2000:]
        assert LAYOUT_ERRORS[case][1] in last_error_line(subprocess.CompletedProcess([], code, "", log)), log[-2000:]
    assert not save.exists() or not any(save.iterdir())
