"""No Python garbage collection inside a training step (``integration/trainer.py``
``no_gc_pause``): with the collector's threshold at 10 allocations, ``fairseq-train`` runs
collections between steps and none inside one; stock fairseq's trainer (no ``--user-dir``) is
the reference that shows the probe sees collections inside a step when nothing prevents them."""

from __future__ import annotations

import re
import sys

from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, WORKERS, run_many

PROBE = WORKERS / "gc_probe_cli.py"


def counts(proc) -> dict[str, int]:
    found = re.search(r"GC_PROBE inside=(\d+) outside=(\d+)", proc.stdout + proc.stderr)
    assert found, (proc.stdout + proc.stderr)[-2000:]
    return {"inside": int(found[1]), "outside": int(found[2])}


def test_no_collection_inside_a_training_step(lm_data, tmp_path):
    common = [lm_data, "--max-update", "3", "--no-save", *LM_TRAIN, "--disable-validation"]
    ours, stock = run_many([
        [sys.executable, PROBE, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--save-dir", tmp_path / "a", *common],
        [sys.executable, PROBE, "--arch", "transformer_lm", "--decoder-layers", "2", "--decoder-embed-dim", "32",
         "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2", "--save-dir", tmp_path / "b", *common],
    ])
    assert counts(stock)["inside"] > 0  # the probe sees collections in a step when nothing prevents them
    got = counts(ours)
    assert got["inside"] == 0 and got["outside"] > 0, got
