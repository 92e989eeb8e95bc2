"""Every case of the bad-input matrix exits non-zero with one line naming the problem,
no traceback, nothing written, nothing overwritten."""

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.bad_inputs import CASES, render_troubleshooting
from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, last_error_line, make_text, run, run_many, tool
from torchscale_fairseq.errors import _fairseq_input_error

REPO = Path(__file__).resolve().parents[2]


class RunsCodeOnLoad:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.fixture(scope="module")
def ctx(lm_data, mt_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    other = root / "other"
    other.mkdir()
    make_text(other / "train.txt", 40, 5)
    (other / "train.txt").write_text((other / "train.txt").read_text() + " ".join(f"x{i}" for i in range(40)) + "\n")
    run([tool("fairseq-preprocess"), "--only-source", "--trainpref", other / "train.txt", "--validpref",
         other / "train.txt", "--destdir", other / "bin", "--workers", "1"])
    split = root / "split"
    run([tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt", "--trainpref",
         mt_data.parent / "train", "--validpref", mt_data.parent / "valid", "--destdir", split, "--workers", "1"])
    ck = root / "ck"
    run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update", "1",
         "--save-dir", ck, *LM_TRAIN])
    good = (ck / "checkpoint_last.pt").read_bytes()
    (root / "corrupt.pt").write_bytes(bytes(reversed(good[:4096])) + good[4096:])
    (root / "truncated.pt").write_bytes(good[: len(good) // 2])
    torch.save({"model": {}, "payload": RunsCodeOnLoad()}, root / "evil.pt")
    (root / "empty").mkdir()
    (root / "no_train").mkdir()
    shutil.copy(lm_data / "dict.txt", root / "no_train" / "dict.txt")
    return {
        "lm_data": str(lm_data), "mt_data": str(mt_data), "mt_split_data": str(split),
        "other_lm_data": str(other / "bin"), "lm_ckpt": str(ck / "checkpoint_last.pt"),
        "corrupt_ckpt": str(root / "corrupt.pt"), "truncated_ckpt": str(root / "truncated.pt"),
        "evil_ckpt": str(root / "evil.pt"), "missing_dir": str(root / "does-not-exist"),
        "empty_dir": str(root / "empty"), "no_train_dir": str(root / "no_train"), "root": root,
    }


def _snapshot(root: Path) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def outcomes(ctx, tmp_path_factory) -> dict:
    """Every case's process and the resume with another dictionary (run a few at a time), with the
    fixture files hashed before and after all of them."""
    saves = tmp_path_factory.mktemp("bad_saves")
    before = _snapshot(ctx["root"])
    resume = tmp_path_factory.mktemp("resume") / "ck"
    shutil.copytree(Path(ctx["lm_ckpt"]).parent, resume)
    resume_before = _snapshot(resume)
    cmds = [case.command({**ctx, "save": str(saves / str(i))}) for i, case in enumerate(CASES)]
    cmds.append([tool("fairseq-train"), ctx["other_lm_data"], "--user-dir", USER_DIR, "--arch", "ts_lm_tiny",
                 "--max-update", "4", "--save-dir", resume, *LM_TRAIN])
    procs = run_many(cmds, check=False)
    return {"procs": {case.name: (saves / str(i), proc) for i, (case, proc) in enumerate(zip(CASES, procs))},
            "before": before, "after": _snapshot(ctx["root"]),
            "resume": (resume, resume_before, procs[-1])}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case, outcomes):
    save, proc = outcomes["procs"][case.name]
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = last_error_line(proc)
    assert case.expect in line, line
    assert case.fix in line, line
    assert not save.exists() or not any(save.iterdir())
    assert outcomes["after"] == outcomes["before"]
    assert "this must never run" not in proc.stdout + proc.stderr


def test_readme_troubleshooting_is_in_step_with_the_matrix():
    assert render_troubleshooting() in (REPO / "README.md").read_text()


def test_dictionary_mismatch_on_resume_keeps_the_checkpoint_in_place(outcomes):
    """Resuming from the save directory's own checkpoint_last.pt with another dictionary."""
    save, before, proc = outcomes["resume"]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "dict.txt" in last_error_line(proc)
    assert _snapshot(save) == before


def test_only_a_missing_dictionary_or_data_set_is_blamed_on_the_data_directory():
    """A missing ``dict.txt`` / ``dict.en.txt`` or split is a data problem; any other missing file
    (a checkpoint, a save dir's file) is named without blaming the data."""
    def message(filename):
        return _fairseq_input_error(FileNotFoundError(2, "No such file or directory", filename))

    for data_file in ("/d/dict.txt", "/d/dict.en.txt"):
        assert "check the data directory" in message(data_file) and data_file in message(data_file)
    assert "check the data directory" in _fairseq_input_error(FileNotFoundError("Dataset not found: train (/d)"))
    other = message("/ckpt/model.pt")
    assert "/ckpt/model.pt" in other and "data directory" not in other and "check that the path exists" in other
    assert _fairseq_input_error(FileNotFoundError("/x/module")) == "/x/module; check that the path exists"
