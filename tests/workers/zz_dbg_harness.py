"""Drive the plugin's trainer (the ``Trainer`` subclass ``fairseq-train`` uses) on fixed
global batches, on 1 process or on W gloo processes (each taking its slice of the global
batch, in ``--update-freq`` micro-batches), and save per update the global
loss, the gradient norm the trainer clipped with and the logged metrics, and at the end
the full parameters (expert shards gathered) for comparison.

Usage: ``python -m tests.workers.dist_harness OUT WORLD DATA [extra fairseq flags...]``; with
``TS_HARNESS_DEVICE=cuda`` the trainer runs on CUDA (every rank on the current GPU) instead of ``--cpu``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.helpers.rendezvous import leave_process_group, rendezvous_url, start_ranks

USER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "torchscale_fairseq")
BATCH, LENGTH, UPDATES = 8, 32, 2
DEVICE_FLAGS = [] if os.environ.get("TS_HARNESS_DEVICE", "cpu") == "cuda" else ["--cpu"]


def global_batches(vocab: int, pad: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(pad + 1, vocab, (BATCH, LENGTH + 1), generator=g) for _ in range(UPDATES)]


def sample_of(tokens: torch.Tensor) -> dict:
    src, tgt = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return {
        "id": torch.arange(src.size(0)),
        "net_input": {"src_tokens": src, "src_lengths": torch.full((src.size(0),), src.size(1))},
        "target": tgt, "ntokens": tgt.numel(), "nsentences": src.size(0),
    }


def worker(rank: int, world: int, init_method: str, out: str, data: str, extra: list[str]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils
    from fairseq.logging import metrics

    from torchscale_fairseq.integration.trainer import TsTrainer
    from torchscale_fairseq.model_parallel.attributes import expert_parallel_size, is_expert

    argv = [data, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_tiny", *DEVICE_FLAGS,
            "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
            "--decoder-layers", "2", "--context-parallel-size", str(world), "--tokens-per-sample", str(LENGTH), "--dropout", "0", "--seed", "7",
            "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "4096", "--distributed-world-size", str(world),
            "--distributed-backend", "gloo", *extra]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    if world > 1:
        cfg.distributed_training.distributed_rank = rank
        cfg.distributed_training.distributed_init_method = init_method
        distributed_utils.distributed_init(cfg)
    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    trainer = TsTrainer(cfg, task, model, criterion)
    dictionary = task.target_dictionary
    seen = []
    forward = criterion.forward

    def recording_forward(model, sample, reduce=True):
        loss, size, log = forward(model, sample, reduce)
        seen.append(torch.tensor([float(log["loss"]), float(size)], dtype=torch.float64))
        return loss, size, log

    criterion.forward = recording_forward
    norms, logged = [], []
    clip = trainer.clip_grad_norm

    def recording_clip(clip_norm):
        norm = clip(clip_norm)
        norms.append(float(norm))
        return norm

    trainer.clip_grad_norm = recording_clip
    losses = []
    update_freq = cfg.optimization.update_freq[0]
    micro = BATCH // update_freq
    for tokens in global_batches(len(dictionary), dictionary.pad()):
        start = len(seen)
        with metrics.aggregate(new_root=True) as agg:
            trainer.train_step([sample_of(tokens[i * micro:(i + 1) * micro])
                                for i in range(0, update_freq)])
        logged.append(dict(agg.get_smoothed_values()))
        total = torch.stack(seen[start:]).sum(0)
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(float(total[0] / total[1]))
    state = {}
    for name, p in model.named_parameters():
        t = p.detach().clone()
        group = trainer.parallel.expert_groups_of(expert_parallel_size(p)).group if is_expert(p) else None
        if group is not None:
            parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts)
        state[name] = t
    bias_spread = 0.0  # auxiliary-loss-free expert biases: the largest difference between two ranks' copies
    for name, b in model.named_buffers():
        if name.endswith(".expert_bias"):
            state[name] = b.detach().clone()
            if world > 1:
                copies = [torch.empty_like(b) for _ in range(world)]
                torch.distributed.all_gather(copies, b.contiguous())
                bias_spread = max([bias_spread] + [float((c - b).abs().max()) for c in copies])
    if rank == 0:
        torch.save({"losses": losses, "norms": norms, "logged": logged, "state": state, "bias_spread": bias_spread},
                   out)
    if world > 1:
        leave_process_group()


def main(argv: list[str]) -> None:
    out, world, data, extra = argv[0], int(argv[1]), argv[2], argv[3:]
    init_method = rendezvous_url(Path(out).parent)
    if world == 1:
        worker(0, 1, init_method, out, data, extra)
    else:
        start_ranks(worker, (world, init_method, out, data, extra), world, os.environ.get("TS_HARNESS_DEVICE", "cpu"))


if __name__ == "__main__":
    main(sys.argv[1:])
