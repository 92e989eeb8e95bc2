"""Bad input: a non-zero exit with one line naming the flag and the fix, no traceback,
and existing checkpoints untouched."""

import hashlib
import shutil

import pytest

from tests.cli_utils import LM_TRAIN, USER_DIR, last_error_line, make_text, run, tool

CASES = [
    (["--backbone", "sandwich"], "--backbone"),
    (["--decoder-embed-dim", "100", "--decoder-attention-heads", "8"], "--*-attention-heads"),
    (["--backbone", "deepnorm", "--decoder-normalize-before"], "--decoder-normalize-before"),
    (["--backbone", "deepnorm", "--layernorm-embedding"], "--layernorm-embedding"),
    (["--tokens-per-sample", "64", "--max-target-positions", "32"], "--max-target-positions"),
    (["--xpos", "--rel-pos-buckets", "32"], "--xpos"),
]


@pytest.mark.parametrize("flags,named", CASES, ids=[c[1] + str(i) for i, c in enumerate(CASES)])
def test_bad_flags_fail_in_one_line(lm_data, tmp_path, flags, named):
    proc = run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update", "2",
                "--save-dir", tmp_path / "ck", *LM_TRAIN, *flags], check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert named in last_error_line(proc)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def other_data(tmp_path_factory):
    """Data with a different dictionary (more word types)."""
    root = tmp_path_factory.mktemp("other")
    make_text(root / "train.txt", 50, 7)
    (root / "train.txt").write_text((root / "train.txt").read_text() + " ".join(f"x{i}" for i in range(40)) + "\n")
    out = root / "bin"
    run([tool("fairseq-preprocess"), "--only-source", "--trainpref", root / "train.txt", "--validpref",
         root / "train.txt", "--destdir", out, "--workers", "1"])
    return out


@pytest.fixture(scope="module")
def small_ckpt(lm_data, tmp_path_factory):
    save = tmp_path_factory.mktemp("small_ck")
    run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update", "2",
         "--save-dir", save, *LM_TRAIN])
    return save


def test_dictionary_mismatch_on_resume_keeps_checkpoint(other_data, small_ckpt, tmp_path):
    save = tmp_path / "ck"
    shutil.copytree(small_ckpt, save)
    before = {p.name: _digest(p) for p in save.iterdir()}
    proc = run([tool("fairseq-train"), other_data, "--user-dir", USER_DIR, "--arch", "ts_lm_tiny", "--max-update",
                "4", "--save-dir", save, *LM_TRAIN], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "dict.txt" in last_error_line(proc)
    assert {p.name: _digest(p) for p in save.iterdir()} == before


def test_dictionary_mismatch_in_eval_lm(other_data, small_ckpt):
    proc = run([tool("fairseq-eval-lm"), other_data, "--path", small_ckpt / "checkpoint_last.pt", "--user-dir",
                USER_DIR, "--cpu", "--tokens-per-sample", "32", "--gen-subset", "valid"], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "dict.txt" in last_error_line(proc)
