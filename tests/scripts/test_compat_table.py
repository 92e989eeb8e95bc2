"""The README's "Supported versions" matrix is docs/compat/matrix.jsonl rendered by
scripts/compat_table.py, and the script reads pytest's summary and the cells as written."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compat_table", REPO / "scripts" / "compat_table.py")
compat_table = sys.modules.setdefault("compat_table", importlib.util.module_from_spec(spec))
spec.loader.exec_module(compat_table)


def test_readme_table_equals_the_matrix_file():
    """Every row of README's table is the latest line of its cell in docs/compat/matrix.jsonl."""
    records = [json.loads(t) for t in (REPO / "docs/compat/matrix.jsonl").read_text().splitlines() if t.strip()] \
        if (REPO / "docs/compat/matrix.jsonl").exists() else []
    readme = compat_table.readme_table((REPO / "README.md").read_text())
    rows = readme.splitlines()[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [cell.name for cell in compat_table.CELLS]
    latest = {r["cell"]: r for r in records}
    for row in rows:
        fields = [f.strip() for f in row.strip("|").split("|")]
        r = latest.get(fields[0])
        if r is None:
            assert fields[5] == "not measured at HEAD"
        else:
            assert fields[1:4] == [r["python"], r["torch"], r["numpy"]]
            assert fields[4] == f"{r['transformers']} + {r['transformers_floor']}"
            assert fields[5] == f"{r['passed']} / {r['failed']} / {r['errors']}"
            assert fields[7].startswith(f"{r['date']}, {r['commit']}")
    assert subprocess.run(["python3", str(REPO / "scripts/compat_table.py"), "check"]).returncode == 0


@pytest.mark.parametrize("summary, counts", [
    ("===== 812 passed, 136 deselected, 3 warnings in 788.12s (0:13:08) =====",
     {"passed": 812, "failed": 0, "errors": 0, "deselected": 136, "pytest_seconds": 788.12}),
    ("==== 2 failed, 810 passed, 136 deselected, 1 error in 790.00s (0:13:10) ====",
     {"passed": 810, "failed": 2, "errors": 1, "deselected": 136, "pytest_seconds": 790.0}),
    ("1090 passed in 2578.18s (0:42:58)",  # pytest -q under xdist: no rule of '='
     {"passed": 1090, "failed": 0, "errors": 0, "deselected": 0, "pytest_seconds": 2578.18}),
])
def test_pytest_counts_read_the_last_summary(summary, counts):
    log = "collected 948 items\n===== 1 passed in 0.1s =====\n..F.\n" + summary + "\n"
    assert compat_table.pytest_counts(log) == counts


def test_a_log_without_summary_is_one_line_error():
    with pytest.raises(SystemExit, match="no pytest summary line"):
        compat_table.pytest_counts("Traceback: killed\n")


def test_rendered_row_quotes_the_line():
    line = {"cell": "py313-torchnewest", "date": "2026-11-29 02:40", "commit": "abc1234", "dirty": False,
            "python": "3.13.0", "torch": "2.15.0", "numpy": "2.4.6", "transformers": "5.24.0",
            "transformers_floor": "5.0.0", "passed": 812, "failed": 0, "errors": 0, "minutes": 41.25,
            "workers": 1}
    rows = compat_table.table([line]).splitlines()
    assert "| py313-torchnewest | 3.13.0 | 2.15.0 | 2.4.6 | 5.24.0 + 5.0.0 | 812 / 0 / 0 | 41.25 min (TS_TEST_WORKERS=1) " \
           "| 2026-11-29 02:40, abc1234 |" in rows
    assert "| py311-torch211 | 3.11 | 2.11.0 | 1.26.4 | newest + floor | not measured at HEAD | | |" in rows


def test_matrix_script_names_its_cells_and_refuses_unknown_ones():
    proc = subprocess.run(["bash", str(REPO / "scripts/compat_matrix.sh"), "py39-torch1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("[compat_matrix] error: unknown cell py39-torch1: choose from " +
                                   " ".join(c.name for c in compat_table.CELLS))


def _checkout(root: Path) -> tuple[list[str], Path]:
    """A committed scratch checkout at ``root``: a README holding the generated table, and ``code.py``."""
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    readme = root / "README.md"
    readme.write_text(f"intro\n{compat_table.BEGIN}\n| old |\n{compat_table.END}\nrest\n")
    (root / "code.py").write_text("x = 1\n")
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    return git, readme


def test_a_checkout_whose_only_change_is_the_generated_table_is_not_dirty(tmp_path):
    """The matrix rewrites the README's table after each cell (the next cell's suite checks it): that
    alone is no uncommitted change; any other edit, in the README or another tracked file, is."""
    git, readme = _checkout(tmp_path)
    assert not compat_table.uncommitted(tmp_path)
    readme.write_text(f"intro\n{compat_table.BEGIN}\n| new row |\n| another |\n{compat_table.END}\nrest\n")
    assert not compat_table.uncommitted(tmp_path)
    readme.write_text(readme.read_text().replace("rest", "rest, edited"))
    assert compat_table.uncommitted(tmp_path)
    subprocess.run([*git, "checkout", "-q", "README.md"], check=True)
    (tmp_path / "code.py").write_text("x = 2\n")
    assert compat_table.uncommitted(tmp_path)


def test_tree_state_names_what_a_cell_tests_and_sees_it_change(tmp_path):
    """The state read before a cell's run names HEAD (``+`` with uncommitted changes) and changes with any edit or
    commit during the run, the generated table aside; the README row says so when it did."""
    git, readme = _checkout(tmp_path)
    head = subprocess.run([*git, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True).stdout.strip()
    clean = compat_table.tree_state(tmp_path)
    assert clean.split()[0] == head
    readme.write_text(f"intro\n{compat_table.BEGIN}\n| new |\n{compat_table.END}\nrest\n")
    assert compat_table.tree_state(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    edited = compat_table.tree_state(tmp_path)
    assert edited.split()[0] == head + "+" and edited != clean
    (tmp_path / "code.py").write_text("x = 3\n")
    assert compat_table.tree_state(tmp_path) not in (clean, edited)
    subprocess.run([*git, "commit", "-qam", "d"], check=True)
    assert compat_table.tree_state(tmp_path).split()[0] != head
    line = {"cell": "newest", "date": "2026-12-01 01:00", "commit": head, "dirty": False, "tree_changed": True,
            "python": "3.13.0", "torch": "2.15.0", "numpy": "2.5.5", "transformers": "5.24.0",
            "transformers_floor": "5.0.0", "passed": 1, "failed": 0, "errors": 0, "minutes": 1.0, "workers": 2}
    assert f"| 2026-12-01 01:00, {head} (the tree changed during the run) |" in compat_table.table([line])
