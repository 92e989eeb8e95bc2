"""experiments/source_use.py: its perplexities are stock fairseq-validate's on the real pairs and on a
copy of the split binarised with the sources permuted; its encoder spread is the std computed verse by
verse without padding; its spread at initialisation is that of fairseq-train's initial model."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils

from tests.helpers.cli_utils import MT_TRAIN, USER_DIR, json_logs, run, tool

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import source_use  # noqa: E402

TINY = ["--arch", "ts_transformer_tiny", "--encoder-layers", "2", "--decoder-layers", "2", "--disable-validation",
        "--dropout", "0.0"]


@pytest.fixture(scope="module")
def trained(mt_data: Path, tmp_path_factory) -> Path:
    """A tiny translation model after 40 updates (it has started to read its source)."""
    save = tmp_path_factory.mktemp("source_use") / "run"
    run([tool("fairseq-train"), str(mt_data), "--user-dir", USER_DIR, "--save-dir", str(save), *MT_TRAIN, *TINY,
         "--max-update", "40"])
    return save


def _fairseq_validate_ppl(data: Path, checkpoint: Path) -> float:
    proc = run([tool("fairseq-validate"), str(data), "--user-dir", USER_DIR, "--task", "translation", "--path",
                str(checkpoint), "--max-tokens", "4096", "--cpu", "--log-format", "json"])
    return float(json_logs(proc.stdout + proc.stderr, "valid")[-1]["valid_ppl"])


def test_perplexities_are_fairseq_validate(trained: Path, mt_data: Path, tmp_path: Path) -> None:
    raw = mt_data.parent
    sources = (raw / "valid.src").read_text().splitlines()
    order = list(range(len(sources)))
    random.Random(7).shuffle(order)
    (tmp_path / "valid.src").write_text("\n".join(sources[i] for i in order) + "\n")
    (tmp_path / "valid.tgt").write_text((raw / "valid.tgt").read_text())
    shuffled = tmp_path / "shuffled-bin"
    run([tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt", "--validpref",
         str(tmp_path / "valid"), "--destdir", str(shuffled), "--srcdict", str(mt_data / "dict.src.txt"),
         "--tgtdict", str(mt_data / "dict.tgt.txt"), "--workers", "1"])
    row = source_use.measure(trained, str(mt_data), "valid", None, 7, init=False)
    checkpoint = trained / "checkpoint_last.pt"
    assert row["update"] == 40
    assert row["ppl"] == pytest.approx(_fairseq_validate_ppl(mt_data, checkpoint), abs=0.006)
    assert row["ppl_shuffled"] == pytest.approx(_fairseq_validate_ppl(shuffled, checkpoint), abs=0.006)
    assert row["ppl_shuffled"] > 1.05 * row["ppl"], "the reversal task's model reads its source"


def test_encoder_spread_is_the_unpadded_std(trained: Path, mt_data: Path) -> None:
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(trained / "checkpoint_last.pt")])
    model = models[0].eval()
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    with torch.no_grad():
        vectors = torch.cat([model.encoder(dataset[i]["source"][None])["encoder_out"][0][0] for i in range(20)])
    expected = float(vectors.std(0, unbiased=False).mean())
    assert source_use.encoder_spread(model, dataset, 20) == pytest.approx(expected, rel=1e-5)


def test_spread_at_init_is_fairseq_trains_initial_model(mt_data: Path, tmp_path: Path, capsys) -> None:
    # lr 0 for the one update: the checkpoint holds the model fairseq-train built, unchanged
    run([tool("fairseq-train"), str(mt_data), "--user-dir", USER_DIR, "--save-dir", str(tmp_path / "init"),
         *MT_TRAIN, *TINY, "--lr", "0", "--lr-scheduler", "fixed", "--max-update", "1", "--seed", "3",
         "--backbone", "deepnorm"])
    records = tmp_path / "rows.jsonl"
    source_use.main([str(tmp_path / "init"), "--init", "--max-verses", "30", "--records", str(records)])
    row = capsys.readouterr().out.splitlines()[-1].strip("| ").split(" | ")
    assert row[0] == "init" and row[2] == "1"
    assert row[-1] == row[-2]  # spread at init == spread of the untrained checkpoint (5 decimals)
    (record,) = [json.loads(line) for line in records.read_text().splitlines()]
    assert {k: record[k] for k in ("run", "backbone", "seed", "lr", "update", "verses")} == {
        "run": "init", "backbone": "deepnorm", "seed": 3, "lr": 0.0, "update": 1, "verses": 30}
    assert [f"{record[k]:.5f}" for k in ("spread", "spread_init")] == row[-2:]


def test_bad_inputs_are_one_line_errors(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit, match="no checkpoint at .*checkpoint_last.pt"):
        source_use.main([str(tmp_path)])
    with pytest.raises(SystemExit):
        source_use.main([str(tmp_path), "--max-verses", "1"])
    assert "--max-verses must be at least 2" in capsys.readouterr().err


def test_checkpoints_in_update_order() -> None:
    names = ["checkpoint_2_600.pt", "checkpoint_1_100.pt", "checkpoint_1_50.pt"]
    ordered = sorted((Path("run") / n for n in names), key=source_use.natural_order)
    assert [p.name for p in ordered] == ["checkpoint_1_50.pt", "checkpoint_1_100.pt", "checkpoint_2_600.pt"]
