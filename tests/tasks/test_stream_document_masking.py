"""``--document-masking`` through the tasks: a ``fairseq-train`` run on the stream, and the task /
model combinations that cannot serve it refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.tasks.language_modeling import LanguageModelingTask

from tests.helpers.cli_utils import json_logs, run, tool
from tests.helpers.model_utils import args, dictionary
from tests.helpers.stream_data import make_stream_data
from tests.tasks.conftest import USER_DIR
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.models.lm import TsLanguageModel


def test_fairseq_train_streaming_lm_with_document_masks(tmp_path: Path) -> None:
    make_stream_data(tmp_path, {"c": (2, 6, 1.0)})
    proc = run([tool("fairseq-train"), tmp_path, "--user-dir", USER_DIR, "--task", "streaming_lm", "--arch",
                "ts_lm_tiny", "--document-masking", "--reset-positions-at-documents", "--decoder-learned-pos",
                "--tokens-per-sample", "32", "--batch-size", "4", "--batches-per-epoch", "3", "--max-epoch", "1",
                "--optimizer", "adam", "--lr", "1e-3", "--cpu", "--log-format", "json", "--log-interval", "1",
                "--save-dir", tmp_path / "ck", "--no-save", "--seed", "1"], timeout=600)
    log = proc.stderr + proc.stdout
    train = json_logs(log, "train_inner")
    valid = json_logs(log, "valid")
    assert [int(r["num_updates"]) for r in train] == [1, 2, 3]
    assert all(math.isfinite(float(r["loss"])) for r in train)
    assert valid and math.isfinite(float(valid[-1]["valid_loss"]))


def parsed(data: Path, *argv: str):
    parsed_args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--user-dir", USER_DIR, "--task", "streaming_lm", "--tokens-per-sample", "16", "--batch-size",
        "2", "--cpu", *argv])
    return convert_namespace_to_omegaconf(parsed_args)


def test_model_that_reads_no_document_ids_is_refused(tmp_path: Path) -> None:
    cfg = parsed(make_stream_data(tmp_path, {"c": (1, 2, 1.0)}), "--arch", "transformer_lm_gpt2_tiny",
                 "--document-masking")
    with pytest.raises(TsConfigError, match="needs a model that reads document ids .*TransformerLanguageModel") as err:
        tasks.setup_task(cfg.task).build_model(cfg.model)
    assert "\n" not in str(err.value)


def test_position_reset_on_stock_language_modeling_is_refused() -> None:
    """fairseq's ``--sample-break-mode none`` blocks keep no document boundaries."""
    d = dictionary()
    lm_args = args(reset_positions_at_documents=True, decoder_learned_pos=True)
    lm_args.add_bos_token = False
    task = LanguageModelingTask(lm_args, d, d)
    with pytest.raises(TsConfigError, match="add --document-masking with --task streaming_lm") as err:
        TsLanguageModel.build_model(lm_args, task)
    assert "\n" not in str(err.value)
