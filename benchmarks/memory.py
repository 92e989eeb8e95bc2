"""Activation memory per transformer layer and rank, measured next to Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4).

Measured: the bytes of every tensor one ``ts_lm_large`` layer (h = 1024, a = 16 heads,
FFN 4h) saves for backward in a training forward at sequence ``s`` and batch ``b``,
counted by a ``saved_tensors_hooks`` pack hook once per storage, parameters excluded;
each tensor-parallel rank runs its own layer over gloo (``--tp`` ranks on this machine).

The paper's count, 16-bit activations and 1-byte dropout masks, per layer:
``sbh (34 + 5 a s / h)`` without tensor parallelism, ``sbh (10 + 24/t + 5 a s / (h t))``
with it. Adapted to this layer (same bookkeeping, term by term):

- outside the tensor-parallel region, replicated on every rank: the two LayerNorm
  inputs, the Q/K/V projection input and the FFN input (``4 B``) and the two residual
  dropout masks (``2 M``);
- inside it, divided by ``t``: the attention core's saved Q/K/V, ``q_core`` bytes per
  ``sbh`` (PyTorch's math SDPA, the CPU kernel with dropout, keeps the scaled query and
  the transposed key next to the fused Q/K/V storage: ``5 x 4`` in fp32; in bf16 it
  computes in fp32 and keeps fp32 copies of the three: ``3 x 4``), the output
  projection input (``B``), the GELU input and FC2 input (``8 B``), and Magneto's two
  Sub-LN inputs (``B + 4 B``);
- the attention core's softmax output, dropout mask and dropout output, ``3 A`` bytes per
  ``a s^2 b`` (``A`` = 4: fp32 in both dtypes on the CPU), divided by ``t``.

With ``--checkpoint-activations selective`` the attention core keeps only its inputs, the
fused Q/K/V storage (``3 B`` instead of ``q_core``), and no ``a s^2 b`` term.

``B`` is the activation width (4 fp32, 2 bf16), ``M`` the residual dropout mask width
(this layer keeps the mask in the activation dtype: ``M = B``). With
``--sequence-parallel`` the replicated part is divided by ``t`` as well (each rank holds
``s / t`` positions). With ``--checkpoint-activations full`` a layer saves only its input
(``B``, divided by ``t`` under sequence parallelism).

Optimizer state (``--optimizer-state``): ``--zero-sharding os`` gives each parameter one
owner rank (:func:`torchscale_fairseq.optim.zero.assign_owners`, largest first to the least
loaded rank), which alone keeps its Adam moments (2 x 4 bytes per element); the table
lists the moment bytes per data-parallel rank for the parameters of ``ts_lm_large``
(vocabulary 50,257, shared input/output embedding, built on the meta device) next to the
unsharded size / DP; the tests check on real runs that a rank's optimizer holds exactly the
moments of the parameters it owns.

    .venv/bin/python benchmarks/memory.py [--tp 1 2 4] [--seq 2048] [--dtype float32 bfloat16]
    .venv/bin/python benchmarks/memory.py --optimizer-state [--dp 2 4]

Prints a markdown table (for RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HIDDEN, HEADS, FFN = 1024, 16, 4096  # ts_lm_large (models/lm.py)
WIDTH = {"float32": 4, "bfloat16": 2}
CORE_QKV = {"float32": 5 * 4, "bfloat16": 3 * 4}  # math SDPA's saved Q/K/V bytes per sbh (module docstring)
CORE_SCORES = 3 * 4  # softmax out, dropout mask, dropout out (fp32) per a s^2 b


def formula(s: int, b: int, t: int, dtype: str, magneto: bool, recompute: str, sequence_parallel: bool) -> float:
    """Bytes per layer and rank of the module docstring's adapted count."""
    width = WIDTH[dtype]
    sbh = s * b * HIDDEN
    if recompute == "full":
        return sbh * width / (t if sequence_parallel else 1)
    selective = recompute == "selective"
    replicated = sbh * (4 * width + 2 * width)
    core_qkv = 3 * width if selective else CORE_QKV[dtype]
    sharded = sbh * (core_qkv + width + 8 * width + (5 * width if magneto else 0))
    scores = 0 if selective else HEADS * s * s * b * CORE_SCORES
    return replicated / (t if sequence_parallel else 1) + (sharded + scores) / t


def paper(s: int, b: int, t: int, sequence_parallel: bool, selective: bool) -> float:
    """Korthikanti et al. 2022, eq. 2 (t = 1) and the rows of table 2."""
    sbh = s * b * HIDDEN
    scores = 0 if selective else 5 * HEADS * s / HIDDEN
    if sequence_parallel:
        return sbh / t * (34 + scores)
    return sbh * (10 + 24 / t + scores / t)


def saved_bytes(layer, x) -> int:
    """Bytes of the tensors a training forward of ``layer`` saves for backward, once per
    storage, parameters excluded."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out, _ = layer(x, causal=True)
    del out
    return sum(saved.values())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torchscale_fairseq.architecture.config import StackConfig
    from torchscale_fairseq.architecture.layer import TransformerLayer
    from torchscale_fairseq.model_parallel.parallel_context import build_parallel_context
    from torchscale_fairseq.modules.backbone import build_backbone

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank, world_size=args.world)
    parallel = build_parallel_context(args.world)
    rows = []
    for backbone, recompute, sequence_parallel in configurations(args.world):
        cfg = StackConfig(embed_dim=HIDDEN, ffn_dim=FFN, layers=12, attention_heads=HEADS,
                          backbone=build_backbone(backbone, "decoder_only", 0, 12), max_positions=args.seq,
                          dropout=0.1, attention_dropout=0.1, checkpoint_activations=recompute == "full",
                          selective_recompute=recompute == "selective",
                          parallel=parallel, sequence_parallel=sequence_parallel)
        torch.manual_seed(0)
        layer = TransformerLayer(cfg).to(getattr(torch, args.dtype)).train()
        local = args.seq // args.world if sequence_parallel else args.seq
        x = torch.randn(args.batch, local, HIDDEN, dtype=layer.final_layer_norm.weight.dtype, requires_grad=True)
        rows.append({"config": [backbone, recompute, sequence_parallel], "bytes": saved_bytes(layer, x)})
        del layer
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def configurations(t: int) -> list[tuple[str, str, bool]]:
    """(backbone, recompute, sequence parallel) measured at tensor-parallel size ``t``."""
    return [(backbone, recompute, sp) for backbone in ("magneto", "preln") for recompute in ("none", "selective", "full")
            for sp in ((False, True) if t > 1 else (False,))]


def measure(t: int, seq: int, batch: int, dtype: str) -> list[dict]:
    from benchmarks._common import rendezvous_url

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        base = [sys.executable, __file__, "--seq", str(seq), "--batch", str(batch), "--dtype", dtype,
                "--world", str(t), "--init-method", rendezvous_url(tmp), "--out", str(out)]
        procs = [subprocess.Popen([*base, "--rank", str(r)]) for r in range(t)]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit(f"a rank of the t={t} run failed")
        return json.loads(out.read_text())


def large_lm_parameter_sizes(vocab: int = 50257) -> list[int]:
    """Element counts of ``ts_lm_large``'s parameters (the shared embedding counted once)."""
    import torch
    from fairseq.data import Dictionary
    from fairseq.dataclass.utils import gen_parser_from_dataclass

    from torchscale_fairseq.models import lm

    args = argparse.Namespace(tokens_per_sample=2048, share_decoder_input_output_embed=True)
    lm.ts_lm_large(args)  # layers, width, heads, FFN of the registered architecture
    parser = argparse.ArgumentParser()
    gen_parser_from_dataclass(parser, lm.TsAdaptiveLanguageModelConfig())
    for key, value in vars(parser.parse_args([])).items():
        if not hasattr(args, key):
            setattr(args, key, value)
    dictionary = Dictionary()
    for i in range(vocab - len(dictionary)):
        dictionary.add_symbol(f"w{i}")

    class Task:
        source_dictionary = target_dictionary = dictionary

    with torch.device("meta"):
        model = lm.TsLanguageModel.build_model(args, Task)
    return [p.numel() for p in model.parameters()]


def optimizer_state_table(dp_sizes: list[int]) -> None:
    from torchscale_fairseq.optim.zero import assign_owners

    numels = large_lm_parameter_sizes()
    total, largest = sum(numels), max(numels)
    print(f"ts_lm_large, {total:,} parameters (largest {largest:,}); Adam moments, fp32, bytes per rank\n")
    print("| DP | unsharded | unsharded / DP | largest rank | smallest rank | largest / (unsharded / DP) |")
    print("|---|---|---|---|---|---|")
    for dp in dp_sizes:
        owners = assign_owners(numels, dp, [False] * len(numels))
        per_rank = [8 * sum(n for n, o in zip(numels, owners) if o == r) for r in range(dp)]
        print(f"| {dp} | {8 * total:,} | {8 * total // dp:,} | {max(per_rank):,} | {min(per_rank):,} | "
              f"{max(per_rank) / (8 * total / dp):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=sorted(WIDTH))
    parser.add_argument("--optimizer-state", action="store_true")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--init-method")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rank is not None:
        args.dtype = args.dtype[0]
        worker(args)
        return
    if args.optimizer_state:
        optimizer_state_table(args.dp)
        return
    s, b = args.seq, args.batch
    sbh = s * b * HIDDEN
    print(f"ts_lm_large layer (h={HIDDEN}, a={HEADS}, FFN {FFN}), s={s}, b={b}, dropout 0.1, CPU; "
          "bytes per layer and rank; `/sbh` = bytes / (s b h)\n")
    print("| backbone | dtype | t | SP | recompute | measured /sbh | adapted formula /sbh | measured / formula "
          "| vs t=1 | paper (16-bit) /sbh |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtype:
        results = {t: {tuple(r["config"]): r["bytes"] for r in measure(t, s, b, dtype)} for t in args.tp}
        for backbone, recompute, sp in sorted({c for t in args.tp for c in configurations(t)}):
            base = results[min(args.tp)][(backbone, "none", False)]
            for t in args.tp:
                if (backbone, recompute, sp) not in results[t]:
                    continue
                got = results[t][(backbone, recompute, sp)]
                want = formula(s, b, t, dtype, backbone == "magneto", recompute, sp)
                shown = paper(s, b, t, sp, recompute == "selective") / sbh if recompute != "full" else "-"
                print(f"| {backbone} | {dtype} | {t} | {'yes' if sp else 'no'} | {recompute} | {got / sbh:.1f} | "
                      f"{want / sbh:.1f} | {got / want:.3f} | {got / base:.3f} | "
                      f"{shown if isinstance(shown, str) else f'{shown:.1f}'} |")


if __name__ == "__main__":
    main()
