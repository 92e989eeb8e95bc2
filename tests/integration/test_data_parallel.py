"""Multi-process data-parallel training on CPU (gloo): one process per rank, and torchrun.

With W ranks at batch size b, rank r trains on batches r, r+W, ... of the epoch, which is
what a single process sees with ``--update-freq W``: the per-update losses must match.
"""

import subprocess

import pytest

from tests.helpers.cli_utils import LM_TRAIN, USER_DIR, json_logs, run, tool
from tests.helpers.rendezvous import rendezvous_url

COMMON = [*LM_TRAIN, "--arch", "ts_lm_tiny", "--max-update", "8", "--no-save", "--disable-validation",
          "--dropout", "0.0", "--log-interval", "1", "--batch-size", "8"]


def losses(text: str):
    return [float(r["loss"]) for r in json_logs(text, "train_inner")]


@pytest.fixture(scope="module")
def single_process_losses(lm_data, tmp_path_factory):
    save = tmp_path_factory.mktemp("single")
    proc = run([tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--save-dir", save, "--update-freq", "2",
                *COMMON])
    return losses(proc.stdout + proc.stderr)


def test_two_gloo_processes_match_single_process(lm_data, tmp_path, single_process_losses):
    init_method = rendezvous_url(tmp_path)
    procs = [
        subprocess.Popen(
            [tool("fairseq-train"), str(lm_data), "--user-dir", USER_DIR, "--save-dir", str(tmp_path), *COMMON,
             "--distributed-backend", "gloo", "--distributed-world-size", "2", "--distributed-rank", str(rank),
             "--distributed-init-method", init_method, "--distributed-no-spawn",
             "--ddp-backend", "legacy_ddp"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    got = losses(outs[0])
    assert len(got) == 8
    assert got == pytest.approx(single_process_losses, rel=1e-4)


def test_torchrun_two_processes_on_cpu(lm_data, tmp_path, single_process_losses):
    proc = run([tool("torchrun"), "--nproc_per_node", "2", "--standalone", "--log-dir", tmp_path / "torchrun",
                tool("fairseq-train"), lm_data, "--user-dir", USER_DIR, "--save-dir", tmp_path, *COMMON,
                "--distributed-backend", "gloo"])
    got = losses(proc.stdout + proc.stderr)
    assert len(got) == 8
    assert got == pytest.approx(single_process_losses, rel=1e-4)
