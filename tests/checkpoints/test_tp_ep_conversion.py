"""A checkpoint with tensor-parallel parts *and* expert shards (TP=2 x DP=2, 2 experts,
written by a real 4-process ``fairseq-train``): its files and records, and
``ts-consolidate-experts`` + ``ts-reshard --size 1`` in either order give one file whose
single-process model reproduces the 4-process model's log-probabilities on a fixed batch
(the independent reference, computed by the 4 ranks together); the experts are split over
the tensor-parallel ranks (the default), so conversion also joins their shards. Checkpoints written
before the record had expert fields convert the same way; bad inputs are one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from torchscale_fairseq.checkpoints.layout import RECORD_KEY
from torchscale_fairseq.cli import consolidate_experts, reshard
from torchscale_fairseq.errors import TsConfigError

PARTS = {(k, r): f"checkpoint_last-model_part-{k}-shard{r}.pt" for k in range(2) for r in range(2)}


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _one_file(name: Path, out: Path, consolidate_first: bool) -> Path:
    """``name`` (TP x EP) converted to a single file under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    if consolidate_first:
        consolidate_experts.main([str(name), "-o", str(out / "merged.pt")])
        reshard.main(["--input", str(out / "merged.pt"), "--size", "1", "--output", str(out / "one.pt")])
    else:
        reshard.main(["--input", str(name), "--size", "1", "--output", str(out / "resharded.pt")])
        consolidate_experts.main([str(out / "resharded.pt"), "-o", str(out / "one.pt")])
    return out / "one.pt"


def _copy(run: dict, dest: Path) -> Path:
    shutil.copytree(run["save"], dest)
    return dest / "checkpoint_last.pt"


def test_every_rank_writes_its_part_and_shard_with_its_layout(tp_ep_run):
    assert sorted(p.name for p in tp_ep_run["save"].iterdir()) == sorted(PARTS.values())
    for (k, r), name in PARTS.items():
        state = _load(tp_ep_run["save"] / name)
        record = state["extra_state"][RECORD_KEY]
        assert (record["size"], record["rank"]) == (2, k)
        assert {key: record["expert_parallel"][key] for key in ("size", "rank", "experts")} == {
            "size": 2, "rank": r, "experts": 2}
        assert record["expert_parallel"]["tensors"] and all(".experts." in t for t in record["expert_parallel"]["tensors"])
        # experts split over the tensor-parallel ranks (the default): their split tensors are in the layout
        assert any(t in record["layout"] for t in record["expert_parallel"]["tensors"])
        # Megatron-LM's rank order: tensor-parallel groups are consecutive global ranks
        assert state["cfg"]["distributed_training"]["distributed_rank"] == 2 * r + k
        assert state["cfg"]["checkpoint"]["checkpoint_suffix"] == f"-model_part-{k}"


def _single_process_lprobs(path: Path, data: Path, tokens: torch.Tensor) -> torch.Tensor:
    from fairseq import checkpoint_utils

    models, _ = checkpoint_utils.load_model_ensemble([str(path)], arg_overrides={"data": str(data)})
    model = models[0].eval()
    with torch.no_grad():
        return model.get_normalized_probs(model(tokens[:, :-1]), log_probs=True)


def _nll(lprobs: torch.Tensor, tokens: torch.Tensor) -> float:
    return float(-lprobs.gather(-1, tokens[:, 1:, None]).mean())


@pytest.fixture(scope="module")
def single_files(tp_ep_run, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("converted")
    old = _copy(tp_ep_run, root / "old")
    for path in old.parent.iterdir():  # as saved before the record had rank and expert_parallel
        state = _load(path)
        state["extra_state"][RECORD_KEY] = {key: value for key, value in state["extra_state"][RECORD_KEY].items()
                                            if key not in ("rank", "expert_parallel")}
        torch.save(state, path)
    return {"consolidate_first": _one_file(tp_ep_run["name"], root / "cr", True),
            "reshard_first": _one_file(tp_ep_run["name"], root / "rc", False),
            "old_record": _one_file(old, root / "old_out", True)}


def test_either_order_gives_the_same_single_file(single_files):
    a, b, old = (_load(single_files[k]) for k in ("consolidate_first", "reshard_first", "old_record"))
    assert a["model"].keys() == b["model"].keys() == old["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]) and torch.equal(a["model"][key], old["model"][key]), key
    record = a["extra_state"][RECORD_KEY]
    assert (record["size"], record["expert_parallel"]["size"], record["expert_parallel"]["experts"]) == (1, 1, 2)
    assert a["cfg"]["common"]["model_parallel_size"] == 1
    assert a["cfg"]["distributed_training"]["distributed_world_size"] == 1


@pytest.mark.parametrize("which", ["consolidate_first", "reshard_first"])
def test_single_process_model_equals_the_four_process_model(tp_ep_run, single_files, which):
    tokens, want = tp_ep_run["reference"]["tokens"], tp_ep_run["reference"]["lprobs"]
    got = _single_process_lprobs(single_files[which], tp_ep_run["data"], tokens)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())
    assert _nll(got, tokens) == pytest.approx(_nll(want, tokens), abs=1e-6)


def _drop(name: Path, *files: str) -> None:
    for f in files:
        (name.parent / f).unlink()


def _edit(name: Path, file: str, change) -> None:
    state = _load(name.parent / file)
    change(state)
    torch.save(state, name.parent / file)


def _swap(name: Path, a: str, b: str) -> None:
    (name.parent / a).rename(name.parent / "swap.tmp")
    (name.parent / b).rename(name.parent / a)
    (name.parent / "swap.tmp").rename(name.parent / b)


def _later_step(state: dict) -> None:
    state["optimizer_history"][-1]["num_updates"] += 1


def _other_dense_weight(state: dict) -> None:
    state["model"]["decoder.layers.0.self_attn_layer_norm.weight"] += 1.0


BAD = {
    "missing part": (lambda n: _drop(n, PARTS[(1, 0)]), "reshard", "checkpoint_last-model_part-1-shard0.pt is missing"),
    "missing shard": (lambda n: _drop(n, PARTS[(0, 1)], PARTS[(1, 1)]), "consolidate",
                      "is one of 2 shards but 1 were given"),
    "one shard of a part missing": (lambda n: _drop(n, PARTS[(1, 1)]), "consolidate",
                                    "checkpoint_last-model_part-1-shard1.pt is missing"),
    "a part of a later step": (lambda n: _edit(n, PARTS[(1, 1)], _later_step), "reshard",
                               "parts from different runs or steps"),
    "a shard of a later step": (lambda n: _edit(n, PARTS[(0, 1)], _later_step), "consolidate",
                                "shards from different runs or steps"),
    "a shard of another run": (lambda n: _edit(n, PARTS[(0, 1)], _other_dense_weight), "consolidate",
                               "differ in the dense weight decoder.layers.0.self_attn_layer_norm.weight"),
    "parts renamed": (lambda n: _swap(n, PARTS[(0, 0)], PARTS[(1, 0)]), "reshard",
                      "parts from different runs or renamed files"),
    "a single file beside the parts": (lambda n: shutil.copy(n.parent / PARTS[(0, 0)], n), "reshard",
                                       "has files of different layouts"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_are_one_line(tp_ep_run, tmp_path, case):
    spoil, tool, needle = BAD[case]
    name = _copy(tp_ep_run, tmp_path / "ck")
    spoil(name)
    out = tmp_path / "out" / "x.pt"
    with pytest.raises(TsConfigError) as error:
        if tool == "reshard":
            reshard.main(["--input", str(name), "--size", "1", "--output", str(out)])
        else:
            consolidate_experts.main([str(name), "-o", str(out)])
    message = str(error.value)
    assert needle in message and "\n" not in message, message
    assert not out.parent.exists(), "nothing is written on a refused conversion"


def test_a_file_of_the_grid_named_instead_of_the_checkpoint(tp_ep_run, tmp_path):
    with pytest.raises(TsConfigError, match="names one file of a sharded checkpoint"):
        reshard.main(["--input", str(tp_ep_run["save"] / PARTS[(0, 0)]), "--size", "1", "--output",
                      str(tmp_path / "x.pt")])


def test_export_of_the_tp_ep_checkpoint_equals_the_four_process_model(tp_ep_run, tmp_path, monkeypatch):
    """``ts-export-hf`` reads the tensor-parallel parts with their expert shards directly; the
    exported model, loaded by ``transformers``, gives the 4-process model's log-probabilities."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers", reason="needs the export extra: pip install -e .[export]")
    from torchscale_fairseq.interop.hf_export import export_hf

    export_hf(str(tp_ep_run["name"]), str(tmp_path / "hf"), dict_path=str(tp_ep_run["data"] / "dict.txt"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    tokens, want = tp_ep_run["reference"]["tokens"], tp_ep_run["reference"]["lprobs"]
    with torch.no_grad():
        got = torch.log_softmax(hf(tokens[:, :-1]).logits.float(), dim=-1)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4
