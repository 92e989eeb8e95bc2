"""fairseq-train's save-dir check (``compat/save_dir_check.py``): it uses no fixed file name, so a
user's file named ``dummy`` in the save dir survives it (stock fairseq deletes it, and two runs
starting in one directory remove each other's check file), it creates a missing save dir, and a
save dir that cannot be made or written stops with one line naming it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from fairseq import checkpoint_utils

import torchscale_fairseq  # noqa: F401  (installs the fix)
from torchscale_fairseq.errors import TsConfigError


def test_the_check_leaves_the_save_dir_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "dummy").write_text("a user's notes")
    checkpoint_utils.verify_checkpoint_directory(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dummy"]
    assert (tmp_path / "dummy").read_text() == "a user's notes"


def test_a_missing_save_dir_is_created(tmp_path: Path) -> None:
    checkpoint_utils.verify_checkpoint_directory(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []


def test_a_save_dir_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(TsConfigError, match=r"cannot write to --save-dir .*file/ck: .*writable directory") as error:
        checkpoint_utils.verify_checkpoint_directory(str(tmp_path / "file" / "ck"))
    assert "\n" not in str(error.value)


def test_a_save_dir_where_no_file_can_be_written_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """(as root every directory is writable: the refusal of the file is simulated)"""
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(tempfile, "TemporaryFile", refused)
    with pytest.raises(TsConfigError, match=r"cannot write to --save-dir .*: Permission denied; point --save-dir"):
        checkpoint_utils.verify_checkpoint_directory(str(tmp_path))
