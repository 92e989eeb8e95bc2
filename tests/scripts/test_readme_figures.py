"""The README's quoted figures equal their data files where a machine can check it: the timings
sentence (docs/compat/readme_timings.jsonl, written by scripts/measure_readme.sh) and the GPU
paragraph (benchmarks/gpu_results.jsonl's latest run). The compatibility table: test_compat_table.py."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
sys.path.insert(0, str(REPO / "scripts"))
spec = importlib.util.spec_from_file_location("readme_timings", REPO / "scripts" / "readme_timings.py")
readme_timings = sys.modules.setdefault("readme_timings", importlib.util.module_from_spec(spec))
spec.loader.exec_module(readme_timings)
sys.path.remove(str(REPO / "scripts"))


def between(begin_prefix: str, end: str) -> str:
    start = README.index(begin_prefix)
    return README[README.index("\n", start) + 1:README.index(end, start)]


def test_readme_timings_equal_the_last_measurement():
    """The sentence quotes the file's last line (or says "not measured" when there is none)."""
    path = REPO / "docs/compat/readme_timings.jsonl"
    lines = [json.loads(t) for t in path.read_text().splitlines() if t.strip()] if path.exists() else []
    text = between("<!-- readme-timings:begin", "<!-- readme-timings:end -->")
    if not lines:
        assert "not measured yet" in text
    else:
        last = lines[-1]
        assert f"commit {last['commit']}" in text
        assert f"`bash scripts/demo.sh` {last['demo_seconds'] / 60:.1f} min" in text
        assert f"`bash scripts/test.sh` {last['test_seconds'] / 60:.1f} min" in text
        for name in readme_timings.DEMO_FIGURES:
            assert f"{last[name]:g}" in text, name
    assert subprocess.run(["python3", str(REPO / "scripts/readme_timings.py"), "check"]).returncode == 0


def test_readme_timings_read_the_demo_summary():
    """The figures are read from the summary lines scripts/demo.sh prints (its echo formats)."""
    demo = (REPO / "scripts/demo.sh").read_text()
    for echo in ('echo "valid:       perplexity', 'echo "baseline:    perplexity', 'echo "nmt test:    BLEU',
                 'echo "baseline:    BLEU'):
        assert echo in demo, echo
    log = """[demo] plots into /x
================ demo summary ================
valid:       perplexity 321.45 (loss 8.33 bits/token) on the held-out articles
baseline:    perplexity 912.3 for word frequencies alone (add-one unigram of the training tokens);
nmt test:    BLEU 3.51, chrF 17.02 on the held-out test verses (x; sacrebleu y)
baseline:    BLEU 1.2, chrF 11.9 for copying the English verse unchanged (shared names and numbers only)
"""
    assert readme_timings.demo_figures(log) == {"valid_ppl": 321.45, "unigram_ppl": 912.3, "bleu": 3.51,
                                                "chrf": 17.02, "copy_bleu": 1.2, "copy_chrf": 11.9}
    with pytest.raises(SystemExit, match="no bleu line"):
        readme_timings.demo_figures(log.replace("nmt test:", "nmt:"))


def test_measure_script_refuses_a_used_folder(tmp_path):
    (tmp_path / "demo").mkdir()
    proc = subprocess.run(["bash", str(REPO / "scripts/measure_readme.sh")], env={"PATH": "/usr/bin:/bin",
                          "MEASURE_DIR": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"[measure_readme] error: {tmp_path} already holds demo/ or test/: give a new "
                                   "MEASURE_DIR (each command needs a fresh clone)")


def test_gpu_paragraph_quotes_the_latest_gpu_run():
    """Every figure of the latest run (the last line's commit) appears, to 3 significant digits, with its commit."""
    records = [json.loads(t) for t in (REPO / "benchmarks/gpu_results.jsonl").read_text().splitlines() if t.strip()]
    commit = records[-1]["commit"]
    run = [r for r in records if r["commit"] == commit]
    text = " ".join(between("<!-- gpu-latest:begin", "<!-- gpu-latest:end -->").split())
    assert f"code of **{commit}**" in text
    assert run[0]["torch"] in text
    numbers = set(re.findall(r"\d+(?:\.\d+)?", text))
    for r in run:
        assert f"{r['value']:#.3g}".rstrip(".") in numbers, (r["metric"], r["value"])  # 139.03: "139"
        if r["target"] is not None:
            assert re.search(rf"(target (of )?|against ){r['target']:g}\b", text), (r["metric"], r["target"])
