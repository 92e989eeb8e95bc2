"""Where the time goes: torch.profiler op tables of one model's training step or of its
beam search, to read next to the throughput/MFU/generation benchmarks. Prints the ops by
self CPU time, then grouped by input shape (which names the layer: e.g. a LayerNorm over
the FFN width is Magneto's Sub-LN in ``modules/feedforward.py``).

    # training step of ts_lm_large (4096 tokens), synthetic 10k vocabulary, no data needed
    .venv/bin/python benchmarks/profile_ops.py train --model-args "--arch ts_lm_large" \
        --tokens-per-sample 512 --batch-size 8
    # the same for the stock model of benchmarks/train_throughput.py
    .venv/bin/python benchmarks/profile_ops.py train --model-args "--arch transformer_lm --decoder-layers 6 \
        --decoder-embed-dim 512 --decoder-attention-heads 8 --decoder-ffn-embed-dim 2048"
    # ts_lm (Magneto) and stock transformer_lm of benchmarks/train_throughput.py in one process,
    # steps interleaved (both see the same load), self CPU seconds per op side by side
    .venv/bin/python benchmarks/profile_ops.py compare --rounds 4
    # beam search of a checkpoint (e.g. one left by benchmarks/generation.py --workdir W)
    .venv/bin/python benchmarks/profile_ops.py generate --data W/data-bin --path W/ckpt_ours/checkpoint_last.pt
"""

from __future__ import annotations

import argparse
import collections
import shlex
import sys
import time
from argparse import Namespace

import torch
from _common import fairseq_lm, import_plugin, lm_sample
from torch.profiler import ProfilerActivity, profile

LM_DIMS = ("--decoder-layers 6 --decoder-embed-dim 512 --decoder-attention-heads 8 "
           "--decoder-ffn-embed-dim 2048")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train", help="one training step (forward, backward, grad norm, Adam)")
    t.add_argument("--model-args", default="--arch ts_lm_large --backbone magneto")
    t.add_argument("--vocab", type=int, default=10000)
    t.add_argument("--tokens-per-sample", type=int, default=256)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--steps", type=int, default=1, help="profiled steps (after one warm-up step)")
    c = sub.add_parser("compare", help="training steps of two models, interleaved, op tables side by side")
    c.add_argument("--model-args", default=f"--arch ts_lm {LM_DIMS} --backbone magneto")
    c.add_argument("--stock-args", default=f"--arch transformer_lm {LM_DIMS}")
    c.add_argument("--vocab", type=int, default=10000)
    c.add_argument("--tokens-per-sample", type=int, default=256)
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--rounds", type=int, default=2, help="profiled steps per model (after one warm-up step each)")
    g = sub.add_parser("generate", help="beam search on the test split")
    g.add_argument("--data", required=True)
    g.add_argument("--path", required=True)
    g.add_argument("--beam", type=int, default=5)
    g.add_argument("--length", type=int, default=20)
    g.add_argument("--batch-size", type=int, default=25)
    g.add_argument("--batches", type=int, default=1)
    p.add_argument("--rows", type=int, default=30)
    return p.parse_args(argv)


def train_step_fn(args):
    from fairseq import optim

    cfg, task, model, criterion = fairseq_lm(shlex.split(args.model_args), args.vocab, args.tokens_per_sample)
    optimizer = optim.build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])
    model.train()
    sample = lm_sample(task.dictionary, args.batch_size, args.tokens_per_sample)
    print(f"params: {sum(p.numel() for p in model.parameters()):,}; tokens/step: {sample['ntokens']}")

    def step():
        optimizer.zero_grad()
        loss, sample_size, _ = criterion(model, sample)
        loss.backward()
        optimizer.multiply_grads(1.0 / sample_size)
        optimizer.clip_grad_norm(0.0)
        optimizer.step()

    return step, args.steps


def generate_fn(args):
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator

    import_plugin()
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([args.path], arg_overrides={"data": args.data})
    for m in models:
        m.eval()
    task.load_dataset("test")
    gen = SequenceGenerator(models, task.target_dictionary, beam_size=args.beam, min_len=args.length,
                            max_len_a=0, max_len_b=args.length)
    itr = task.get_batch_iterator(task.dataset("test"), max_sentences=args.batch_size,
                                  max_positions=(1024, 1024)).next_epoch_itr(shuffle=False)
    batches = [next(itr) for _ in range(args.batches)]

    def step():
        with torch.no_grad():
            for s in batches:
                gen.generate(models, s)

    return step, 1


def compare(args) -> None:
    """Alternate profiled steps of the two models (ours first in even rounds) and print
    wall time and self CPU seconds per op for each."""
    steps = {}
    for name, model_args in (("ours", args.model_args), ("stock", args.stock_args)):
        torch.manual_seed(1)
        steps[name] = train_step_fn(Namespace(**{**vars(args), "model_args": model_args, "steps": 1}))[0]
        steps[name]()  # warm-up
    self_s = {name: collections.defaultdict(lambda: [0.0, 0]) for name in steps}
    wall = dict.fromkeys(steps, 0.0)
    for r in range(args.rounds):
        for name in (("ours", "stock") if r % 2 == 0 else ("stock", "ours")):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                steps[name]()
                wall[name] += time.perf_counter() - t0
            for e in prof.key_averages():
                self_s[name][e.key][0] += e.self_cpu_time_total / 1e6
                self_s[name][e.key][1] += e.count
    print(f"{args.rounds} step(s) each; wall s: ours {wall['ours']:.2f}, stock {wall['stock']:.2f}, "
          f"ratio stock/ours {wall['stock'] / wall['ours']:.3f} (torch threads {torch.get_num_threads()})")
    keys = sorted(set(self_s["ours"]) | set(self_s["stock"]),
                  key=lambda k: -max(self_s["ours"][k][0], self_s["stock"][k][0]))
    print(f"{'op':64s} {'ours s':>8s} {'calls':>6s} {'stock s':>8s} {'calls':>6s}")
    for k in keys[: args.rows]:
        (o, on), (s, sn) = self_s["ours"][k], self_s["stock"][k]
        print(f"{k[:64]:64s} {o:8.3f} {on:6d} {s:8.3f} {sn:6d}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.what == "compare":
        compare(args)
        return 0
    step, n = train_step_fn(args) if args.what == "train" else generate_fn(args)
    t0 = time.perf_counter()
    step()  # warm-up
    print(f"warm-up step: {time.perf_counter() - t0:.2f}s")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        wall = time.perf_counter() - t0
    print(f"profiled: {n} step(s) in {wall:.2f}s wall (torch threads {torch.get_num_threads()})")
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
