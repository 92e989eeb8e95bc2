"""Per-rank bytes of parameters, gradients and optimizer state under DDP, ``--zero-sharding os``
and ``--zero-sharding full``, measured in real ``fairseq-train`` runs (CPU, gloo), next to the ZeRO
paper's formulas (Rajbhandari et al. 2020, section 3.1 and figure 1).

With ``Psi`` parameters, ``N`` data-parallel ranks and ``K`` optimizer bytes per parameter, a rank
holds ``P + G + K`` bytes per parameter under DDP, ``P + G + K / N`` under ZeRO-1 (``os``) and
``(P + G + K) / N`` under ZeRO-3 (``full``). The paper's mixed-precision Adam has ``P = G = 2``
(fp16) and ``K = 12`` (fp32 master, momentum, variance): ``16 Psi``, ``4 Psi + 12 Psi / N``,
``16 Psi / N``. These CPU runs train in fp32 with no master copy: ``P = G = 4``, ``K = 8`` (the two
moments), so ``16 Psi``, ``8 Psi + 8 Psi / N``, ``16 Psi / N``; ``full --bf16`` keeps fp32 shards
and reduces in fp32 (bf16 only for compute), the same ``16 Psi / N``.

Measured after update 1 of ``ts_lm`` (``--dims``, vocabulary of the synthetic corpus, shared
input/output embedding): parameters as the model holds them (a DTensor's local shard), their
``.grad``, and every tensor in the torch optimizer's state (a DTensor's local shard); a tied
tensor once. ``Psi`` is the model's parameter count. Each rank is one thread.

    .venv/bin/python benchmarks/zero_memory.py [--dp 2 4] [--dims "4 256 4 1024"]

Prints a markdown table (for RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _common import (
    USER_DIR,
    decoder_dim_flags,
    device_line,
    git_commit,
    now,
    preprocess_lm,
    rendezvous_url,
    run_together,
    write_lm_corpus,
)

MODES = {"ddp": [], "os": ["--zero-sharding", "os"], "full": ["--zero-sharding", "full"],
         "full --bf16": ["--zero-sharding", "full", "--bf16"]}
FORMULA = {  # bytes per parameter per rank, fp32 training with Adam (module docstring)
    "ddp": lambda n: 16.0, "os": lambda n: 8.0 + 8.0 / n, "full": lambda n: 16.0 / n, "full --bf16": lambda n: 16.0 / n,
}
RECORD = "zero-memory "


def _worker() -> None:
    """``zero_memory.py --worker ARGS``: ``fairseq-train ARGS``, printing this rank's bytes after update 1."""
    import torch
    from fairseq_cli.train import cli_main
    from torch.distributed.tensor import DTensor

    import torchscale_fairseq  # noqa: F401  (installs the plugin)
    from torchscale_fairseq.integration.trainer import TsTrainer

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    train_step = TsTrainer.train_step

    def measured_step(self, samples, raise_oom=False):
        out = train_step(self, samples, raise_oom)
        params = list(self.model.parameters())  # unique: a tied tensor once
        state = [v for s in self.optimizer.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0]
        print(RECORD + json.dumps({
            "rank": self.data_parallel_rank, "psi": sum(p.numel() for p in params),
            "params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local_bytes(v) for v in state)}), flush=True)
        return out

    TsTrainer.train_step = measured_step
    sys.argv = ["fairseq-train", *sys.argv[2:]]
    cli_main()


def _measure(data: Path, work: Path, mode: str, dp: int, dims: str) -> list[dict]:
    out = work / f"{mode.replace(' ', '')}-dp{dp}"
    init = rendezvous_url(out)
    base = [sys.executable, str(Path(__file__).resolve()), "--worker", str(data), "--user-dir", str(USER_DIR),
            "--task", "language_modeling", "--arch", "ts_lm", *decoder_dim_flags(dims),
            "--share-decoder-input-output-embed", "--tokens-per-sample", "64", "--sample-break-mode", "none",
            "--batch-size", "2", "--optimizer", "adam", "--lr", "1e-4", "--max-update", "1", "--cpu",
            "--no-save", "--save-dir", str(out / "checkpoints"), "--disable-validation", "--num-workers", "0",
            "--seed", "1", *MODES[mode]]
    cmds = [[*base, "--distributed-world-size", str(dp), "--distributed-rank", str(r), "--distributed-init-method",
             init, "--distributed-no-spawn", "--distributed-backend", "gloo"] for r in range(dp)]
    outputs = run_together(cmds, [out / f"{r}.log" for r in range(dp)], env={"OMP_NUM_THREADS": "1"})
    return [json.loads(line[len(RECORD):]) for text in outputs for line in text.splitlines()
            if line.startswith(RECORD)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel sizes")
    p.add_argument("--dims", default="4 256 4 1024", help="decoder 'layers width heads ffn_width'")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--workdir", help="keep the data and logs here (default: a temporary directory)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        data = preprocess_lm(write_lm_corpus(work / "text", vocab=2000, tokens=20000), work / "bin")
        print(f"# {now()} | {device_line('cpu')} | commit {git_commit()} | decoder {args.dims}, fp32 Adam, gloo")
        print("| mode | DP | Psi | params MB | grads MB | optimizer MB | total MB / rank (max) | formula MB | "
              "measured / formula |")
        print("|---|---|---|---|---|---|---|---|---|")
        for dp in args.dp:
            for mode in args.modes:
                ranks = _measure(data, work, mode, dp, args.dims)
                worst = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
                total = worst["params"] + worst["grads"] + worst["optimizer"]
                formula = FORMULA[mode](dp) * worst["psi"]
                mb = [v / 2**20 for v in (worst["params"], worst["grads"], worst["optimizer"], total, formula)]
                print(f"| {mode} | {dp} | {worst['psi']:,} | " + " | ".join(f"{v:.2f}" for v in mb)
                      + f" | {total / formula:.3f} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker()
    else:
        main()
