"""Update time with ``--optimizer sparse_clip --sparse-clip-base adam`` vs ``--optimizer
adam`` (vanilla ``--clip-norm``) on an MoE ``ts_lm`` with 64 experts, in the same run:
two fairseq ``Trainer`` s with the same model and batch, steps interleaved A/B so both
see the same machine load. Also times the clipping call alone. Target overhead <= 2%.

Usage: ``.venv/bin/python benchmarks/sparse_clip_overhead.py [--steps 20] [--threads 1]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import USER_DIR, lm_sample, load_average, now, preprocess_lm, write_lm_corpus  # noqa: E402


def build(data: Path, optimizer: list[str], dim: int, experts: int):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    argv = [str(data), "--user-dir", str(USER_DIR), "--task", "language_modeling", "--arch", "ts_lm_tiny", "--cpu",
            "--decoder-layers", "4", "--decoder-embed-dim", str(dim), "--decoder-ffn-embed-dim", str(4 * dim),
            "--decoder-attention-heads", "4", "--tokens-per-sample", "128", "--moe-expert-count", str(experts),
            "--moe-freq", "2", "--criterion", "moe_cross_entropy", "--clip-norm", "1.0", "--lr", "1e-4",
            "--adam-betas", "(0.9, 0.98)", "--seed", "1", "--max-tokens", "100000", *optimizer]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(1)
    model = task.build_model(cfg.model)
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    clip_times: list[float] = []
    clip = trainer.clip_grad_norm

    def timed_clip(max_norm):
        start = time.perf_counter()
        out = clip(max_norm)
        clip_times.append(time.perf_counter() - start)
        return out

    trainer.clip_grad_norm = timed_clip
    return trainer, task, clip_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data = preprocess_lm(write_lm_corpus(Path(tmp) / "text", vocab=60, tokens=6000), Path(tmp) / "lm-bin")
        runs = {
            "vanilla": build(data, ["--optimizer", "adam"], args.dim, args.experts),
            "sparse_clip": build(data, ["--optimizer", "sparse_clip", "--sparse-clip-base", "adam"],
                                 args.dim, args.experts),
        }
        sample = lm_sample(runs["vanilla"][1].target_dictionary, args.batch, 128, torch.Generator().manual_seed(0))
        step_times: dict[str, list[float]] = {k: [] for k in runs}
        for i in range(args.steps + 2):
            order = list(runs) if i % 2 == 0 else list(reversed(runs))
            for name in order:
                start = time.perf_counter()
                runs[name][0].train_step([sample])
                if i >= 2:
                    step_times[name].append(time.perf_counter() - start)
    params = sum(p.numel() for p in runs["vanilla"][0].model.parameters())
    print(f"# {now()} | load {load_average()} | threads {args.threads} | ts_lm 4 layers d={args.dim} "
          f"E={args.experts} moe_freq 2 ({params / 1e6:.1f}M params) | batch {args.batch}x128 "
          f"| {args.steps} steps each")
    print("| optimizer | median update (ms) | mean update (ms) | median clip call (ms) |")
    print("|---|---|---|---|")
    for name, (_, _, clips) in runs.items():
        t = step_times[name]
        print(f"| {name} | {1e3 * statistics.median(t):.1f} | {1e3 * statistics.mean(t):.1f} | "
              f"{1e3 * statistics.median(clips[2:]):.2f} |")
    overhead = statistics.median(step_times["sparse_clip"]) / statistics.median(step_times["vanilla"]) - 1
    mean_overhead = statistics.mean(step_times["sparse_clip"]) / statistics.mean(step_times["vanilla"]) - 1
    clip_extra = statistics.median(runs["sparse_clip"][2][2:]) - statistics.median(runs["vanilla"][2][2:])
    share = clip_extra / statistics.median(step_times["vanilla"])
    print(f"overhead of SparseClip: median update {100 * overhead:+.2f}%, mean update {100 * mean_overhead:+.2f}%, "
          f"clip call {1e3 * clip_extra:+.2f} ms = {100 * share:+.2f}% of an update")


if __name__ == "__main__":
    main()
