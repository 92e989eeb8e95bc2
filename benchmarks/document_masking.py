"""Document-masked packing (issue 46): training-step throughput and memory of ``ts_lm`` on packed
blocks with ``document_ids`` (attention within documents, optionally positions reset) against
plain causal blocks of the same tokens.

``tokens/s``: forward + backward + SGD step, median of the timed steps, the three modes' steps
interleaved in one process (so that the shared machine's load hits them alike). Memory, each mode
in its own process: ``saved MiB`` the bytes the layers keep for backward (``saved_tensors_hooks``,
once per storage, parameters excluded; the shared document mask counts once), ``peak RSS MiB``
the process's resident high-water mark after two steps. Document lengths are exponential with
mean ``--mean-doc`` tokens (the streaming tasks' packing of short documents).

    .venv/bin/python benchmarks/document_masking.py [--seq 1024] [--batch 4] [--mean-doc 256]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from _common import REPO, git_commit, load_average, now

sys.path.insert(0, str(REPO))

MODES = ("causal", "document", "document+reset")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--mean-doc", type=float, default=256.0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one configuration (worker process)
    return p.parse_args(argv)


def document_ids(batch: int, seq: int, mean: float, generator: torch.Generator) -> torch.Tensor:
    """Per-row document numbers of exponential(mean) document lengths, at least 1 token each."""
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(max(1, int(torch.empty(1).exponential_(1 / mean, generator=generator))))
        rows.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[:seq])
    return torch.stack(rows)


def saved_mib(model, tokens: torch.Tensor, kwargs: dict) -> float:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model.decoder(tokens, **kwargs)[0]
    del logits
    return total / 2**20


def build(args: argparse.Namespace, mode: str):
    """``ts_lm`` (same weights for every mode), a batch of tokens and the forward's extra inputs."""
    from fairseq.data import Dictionary

    from torchscale_fairseq.models.lm import TsLanguageModel

    torch.manual_seed(0)
    d = Dictionary()
    for i in range(1000):
        d.add_symbol(f"w{i}")
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d, document_masking=mode != "causal")
    model = TsLanguageModel.build_model(argparse.Namespace(
        backbone="magneto", activation_fn="gelu", dropout=0.1, attention_dropout=0.0, activation_dropout=0.0,
        decoder_layers=args.layers, decoder_embed_dim=args.dim, decoder_ffn_embed_dim=4 * args.dim,
        decoder_attention_heads=args.heads, tokens_per_sample=args.seq, max_target_positions=args.seq,
        decoder_learned_pos=True, share_decoder_input_output_embed=True,
        reset_positions_at_documents=mode == "document+reset",
    ), task)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(d.nspecial, len(d), (args.batch, args.seq + 1), generator=g)
    kwargs = {} if mode == "causal" else {"document_ids": document_ids(args.batch, args.seq, args.mean_doc, g)}
    return model, tokens, kwargs, torch.optim.SGD(model.parameters(), lr=1e-3)


def step(model, tokens: torch.Tensor, kwargs: dict, opt) -> float:
    """One forward + backward + SGD step; its seconds."""
    start = time.perf_counter()
    logits = model(tokens[:, :-1], **kwargs)[0]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - start


def memory(args: argparse.Namespace) -> dict:
    """Worker process of one mode: saved bytes and peak RSS after two steps."""
    model, tokens, kwargs, opt = build(args, args.mode)
    for _ in range(2):
        step(model, tokens, kwargs, opt)
    return {"saved_mib": saved_mib(model, tokens[:, :-1], kwargs),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.mode:
        print(json.dumps(memory(args)))
        return
    rows = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], capture_output=True,
                             text=True, check=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    # throughput: the modes' steps interleaved in one process, so that load on the machine hits them alike
    runs = {mode: build(args, mode) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(2 + args.steps):
        for mode in MODES:
            seconds = step(*runs[mode])
            if i >= 2:
                times[mode].append(seconds)
    for mode, (_, _, kwargs, _) in runs.items():
        rows[mode]["tokens_per_s"] = args.batch * args.seq / statistics.median(times[mode])
        rows[mode]["docs_per_row"] = float(kwargs["document_ids"].max(1).values.float().mean() + 1) if kwargs else 1.0
    base = rows["causal"]
    print(f"{now()} commit {git_commit()} load {load_average()} torch {torch.__version__}")
    print(f"ts_lm {args.layers} layers d={args.dim} h={args.heads}, seq {args.seq}, batch {args.batch}, "
          f"mean document {args.mean_doc:g} tokens, fp32, {args.threads} threads, median of {args.steps} steps")
    print("| blocks | documents/row | tokens/s | vs causal | saved MiB | vs causal | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['docs_per_row']:.1f} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.3f} | {r['saved_mib']:.1f} | "
              f"{r['saved_mib'] / base['saved_mib']:.3f} | {r['peak_rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
