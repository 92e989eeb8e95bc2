"""What a training step costs beyond the model's own work (issue 43, item 1): one step of the
same tiny model timed three ways on the CPU, with the aten ops it dispatches and the host
syncs it makes.

    .venv/bin/python benchmarks/step_overhead.py                   # defaults: 20 steps x 5 repeats, 1 thread
    .venv/bin/python benchmarks/step_overhead.py --steps 50 --repeats 7 --threads 2

The three steps, on one batch of ``--batch-size`` x ``--tokens-per-sample`` tokens drawn by a
fixed-seed generator over a dictionary of ``--vocab`` words:

- ``ts_lm``: this plugin's LM (``--model-args``) through fairseq's training step: the
  ``Trainer`` ``fairseq-train --user-dir torchscale_fairseq`` instantiates (the plugin's
  ``TsTrainer``), built as ``fairseq_cli.train.main`` builds it, one update as its loop runs
  it (``trainer.train_step([sample])`` inside ``metrics.aggregate("train_inner")``);
- ``stock``: fairseq's ``transformer_lm`` of the same size (``--stock-args``; its input and
  output dims default to 512, not to ``--decoder-embed-dim``) through the same trainer and step;
- ``bare``: the ``ts_lm`` model object of the first, trained by a bare PyTorch loop:
  forward, cross-entropy, backward, ``torch.optim.Adam`` step, ``zero_grad``.

After ``--warmup`` steps each, ``--repeats`` rounds time ``--steps`` steps of each (the order
rotating between rounds, so drift of the machine's load hits all three alike); a round's
figure is its median step, the table shows the median over rounds and the ratios are the
medians of the per-round ratios. The issue's target, ``ts_lm`` / ``bare`` <= 1.3, is
reported, not asserted.

Aten ops per step: every op that reaches a ``TorchDispatchMode`` in one step (forward,
backward and optimizer), each dispatch once; composite ops count as the ops they decompose
into, ops an op's kernel calls internally are not counted. Under a mode, shallow copies
dispatch ``aten.detach``; those of ``Tensor.data`` reads, the bulk of them (fairseq's Adam
reads ``p.data`` and ``p.grad.data`` per parameter), are left out, a few others (in the
autograd engine) are not, so ``aten.detach`` counts stay a few above torch.profiler's.

Host syncs per step, counted over one step by :class:`SyncCounter`: the calls that, on a
GPU, make the host wait for the device. On the CPU nothing waits, so the counter models
which tensors a CUDA run would hold on the device (:class:`DeviceTensors`): the model's
parameters and buffers and the batch (a fairseq run's once the trainer's ``_prepare_sample``,
which moves it on CUDA, returns it: fairseq's iterator yields it on the host, a fresh copy each
step), and every tensor computed from one of them (or made
with an explicit ``torch.device`` argument, as ``device=x.device`` is), followed through
every aten op and torch function from the first step on, so optimizer state built from the
parameters is a device tensor and ``torch.optim.Adam``'s step counter (a host tensor by
design) is not. Counted, on device tensors only:

- reading a value to the host, seen as the aten op ``_local_scalar_dense`` wherever it is
  called from: ``Tensor.item``, ``__bool__`` (``if t``, ``not t``), ``__float__``, ``__int__``,
  ``__index__``, formatting a 0-dim tensor, ``in``, ``torch.allclose``, a tensor argument
  read as a number (``torch.arange(t)``, ...); and ``torch.equal``;
- copies to the host: ``Tensor.tolist``, ``.numpy()``/``__array__``, ``.cpu()``,
  ``.to("cpu")`` (seen as torch functions: on the CPU they dispatch nothing) and ``copy_``
  into a host tensor;
- ops whose output size depends on the data: ``nonzero`` (so ``torch.where(cond)``,
  ``argwhere``), ``masked_select``, boolean-mask indexing and index assignment, ``unique``
  and ``unique_consecutive``, ``bincount``, ``repeat_interleave`` with a tensor of repeats
  and no ``output_size``.

Not counted: ``torch.cuda`` calls (``synchronize``, events, ``empty_cache``) and waits of
the CUDA caching allocator, which do not run on the CPU; syncs inside CUDA kernels' host
code that the CPU kernels lack (``histc``'s range, ...); scalars read by the C++ argument
parser without a dispatch (``torch.tensor([t0, t1])``); ``.to(d)`` with a ``torch.device``
``d`` (on the CPU it cannot tell a copy to the host from a no-op on the device). A tensor
that ``.cpu()`` returns is the same object on the CPU, so it stays a device tensor: a later
``.item()`` on it counts again. Each sync is listed with where it came from, the first frame
outside torch and the standard library (``file:line (function)``, then that frame's caller):
the place to remove it from.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import inspect
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from _common import REPO, fairseq_lm, lm_sample, load_average, now
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

DIMS = "--decoder-layers 2 --decoder-embed-dim 64 --decoder-attention-heads 2 --decoder-ffn-embed-dim 256"
TARGET = 1.3  # ts_lm / bare loop, issue 43
TOP_SITES = 8
aten = torch.ops.aten


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-args", default=f"--arch ts_lm {DIMS} --backbone magneto")
    p.add_argument("--stock-args", default=f"--arch transformer_lm {DIMS} --decoder-input-dim 64 --decoder-output-dim 64")
    p.add_argument("--vocab", type=int, default=300, help="dictionary words (plus fairseq's 4 special symbols)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokens-per-sample", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each before the rounds")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each per round")
    p.add_argument("--repeats", type=int, default=5, help="rounds")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    return p.parse_args(argv)


# ---------------------------------------------------------------- counting


def _tensors(tree: Any) -> List[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


class DeviceTensors(TorchDispatchMode):
    """The tensors a CUDA run would hold on the device: those :meth:`mark` ed, and while this
    mode is active the outputs of every aten op with one of them among its inputs (``copy_``
    leaves its destination where it is). Weak: a tensor freed is forgotten. ``active``: the
    innermost one entered."""

    active: Optional["DeviceTensors"] = None

    def __init__(self) -> None:
        super().__init__()
        self._held: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._outer: Optional[DeviceTensors] = None

    def __enter__(self) -> "DeviceTensors":
        self._outer, DeviceTensors.active = DeviceTensors.active, self
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        DeviceTensors.active = self._outer
        return super().__exit__(*exc)

    def mark(self, tree: Any) -> None:
        for t in _tensors(tree):
            self._held[t] = True

    def holds(self, tree: Any) -> bool:
        """Whether any tensor in ``tree`` (nested lists, tuples, dicts) is a device tensor."""
        return any(t in self._held for t in _tensors(tree))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not aten.copy_.default and self.holds((args, kwargs)):
            self.mark(out)
        return out


class _DataReads(TorchFunctionMode):
    """Whether a ``Tensor.data`` read is running."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if resolve_name(func) != "torch.Tensor.data.__get__":
            return func(*args, **(kwargs or {}))
        self.active = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.active = False


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (``counts``: op name -> dispatches). A
    ``Tensor.data`` read is not counted: without a mode it is a shallow copy that dispatches
    nothing, under one it dispatches ``aten.detach``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self._data_reads = _DataReads()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> "OpCounter":
        self._data_reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._data_reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._data_reads.active:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


_ALWAYS_SYNC = {aten._local_scalar_dense, aten.equal, aten.allclose, aten.nonzero, aten.masked_select, aten._unique,
                aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive, aten.bincount}
_MASK_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_HOST_COPIES = {"torch.Tensor.tolist", "torch.Tensor.numpy", "torch.Tensor.__array__", "torch.Tensor.cpu"}
_HOST_RESULTS = {*_HOST_COPIES, "_shape_as_tensor"}  # a tensor of sizes is made on the host


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


class _SyncOps(TorchDispatchMode):
    """The dispatch half of :class:`SyncCounter`: the aten ops that sync on device inputs."""

    def __init__(self, counter: "SyncCounter") -> None:
        super().__init__()
        self.counter = counter

    def syncs(self, func, args: tuple, kwargs: dict) -> bool:
        device = self.counter.device
        packet = func.overloadpacket
        if packet in _ALWAYS_SYNC:
            return device.holds(args[0])
        if packet in _MASK_INDEXED:
            return any(_is_mask(i) and device.holds(i) for i in args[1])
        if func is aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None and device.holds(args[0])
        if func is aten.copy_.default:  # a copy into a host tensor
            return device.holds(args[1]) and not device.holds(args[0])
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.syncs(func, args, kwargs):
            self.counter.record(self.counter.calling or str(func))
        return func(*args, **kwargs)


class SyncCounter(TorchFunctionMode):
    """Counts the host syncs of the code run while active (see the module docstring):
    ``sites`` maps (what synced, call site) to a count. Its torch-function half counts the
    copies to the host that dispatch nothing on the CPU, names each sync by the torch call
    it happened in, and marks as device tensors the outputs of calls on device tensors or
    with a ``torch.device`` argument; the aten ops are seen by :class:`_SyncOps` and
    followed by ``device``, which keeps what it learnt for the next use."""

    def __init__(self, device: DeviceTensors) -> None:
        super().__init__()
        self.device = device
        self.sites: collections.Counter = collections.Counter()
        self.calling: Optional[str] = None  # the torch call running (the outermost: calls in it are not seen)
        self._ops = _SyncOps(self)
        self._modes = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def record(self, what: str) -> None:
        self.sites[(what, call_site())] += 1

    def __enter__(self) -> "SyncCounter":
        super().__enter__()
        self._modes.enter_context(self.device)
        self._modes.enter_context(self._ops)
        return self

    def __exit__(self, *exc) -> None:
        self._modes.close()
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = resolve_name(func) or getattr(func, "__name__", repr(func))
        on_device = self.device.holds((args, kwargs))
        to_host = name in _HOST_COPIES or (name == "torch.Tensor.to" and (
            "cpu" in [a for a in args[1:] if isinstance(a, str)] or kwargs.get("device") == "cpu"))
        if on_device and to_host:
            self.record(name)
        self.calling = name
        try:
            out = func(*args, **kwargs)
        finally:
            self.calling = None
        if name not in _HOST_RESULTS and (on_device or any(isinstance(a, torch.device) for a in tree_leaves((args, kwargs)))):
            self.device.mark(out)
        return out


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
_COUNTER_CODE = {inspect.unwrap(f).__code__ for f in (  # (torch wraps each __torch_dispatch__)
    SyncCounter.record, SyncCounter.__torch_function__, DeviceTensors.__torch_dispatch__,
    OpCounter.__torch_dispatch__, _DataReads.__torch_function__, _SyncOps.__torch_dispatch__)}


def _outside(frame: Optional[FrameType]) -> Optional[FrameType]:
    """``frame`` or the nearest of its callers outside torch, the standard library and this module's modes."""
    while frame is not None and (frame.f_code in _COUNTER_CODE or _in_torch_or_stdlib(frame.f_code.co_filename)):
        frame = frame.f_back
    return frame


def _in_torch_or_stdlib(path: str) -> bool:
    return path.startswith(_TORCH_DIR) or (path.startswith(_STDLIB_DIR) and "-packages" + os.sep not in path)


def _where(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    if "site-packages" + os.sep in path:
        path = path.split("site-packages" + os.sep, 1)[1]
    elif path.startswith(str(REPO) + os.sep):
        path = os.path.relpath(path, REPO)
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def call_site() -> str:
    """Where the running code calls into torch: ``file:line (function)`` of the innermost frame
    outside torch, the standard library and this module's modes, then `` <- `` its caller's (the
    next such frame out)."""
    site = _outside(sys._getframe(1))
    if site is None:
        return "?"
    caller = _outside(site.f_back)
    return _where(site) + ("" if caller is None else " <- " + _where(caller))


# ---------------------------------------------------------------- the three steps


@dataclass
class Run:
    """One way of training: ``step()`` runs one update of ``model`` on ``sample`` (``host_batch``:
    on a host copy of it, which the step moves to the device)."""

    name: str
    what: str
    step: Callable[[], None]
    model: torch.nn.Module
    sample: dict
    host_batch: bool = False


def fairseq_run(name: str, model_args: str, vocab: int, sample_shape: Tuple[int, int],
                sample: Optional[dict] = None, seed: int = 1) -> Run:
    """``model_args``'s model trained by the ``Trainer`` fairseq-train uses with this plugin
    (``fairseq_cli.train.Trainer``, the plugin's ``TsTrainer``), one update as fairseq-train's
    loop runs it, on ``sample`` or else a batch of ``sample_shape`` (sentences, tokens) drawn
    by a generator seeded ``seed``."""
    import fairseq_cli.train
    from fairseq.logging import metrics

    batch, length = sample_shape
    torch.manual_seed(seed)
    cfg, task, model, criterion = fairseq_lm([*shlex.split(model_args), "--seed", str(seed)], vocab, length)
    trainer = fairseq_cli.train.Trainer(cfg, task, model, criterion)
    if sample is None:
        sample = lm_sample(task.dictionary, batch, length, torch.Generator().manual_seed(seed))
    prepare = trainer._prepare_sample

    def prepare_and_move(batch: Any, is_dummy: bool = False):  # where fairseq moves the batch to CUDA
        batch, dummy = prepare(batch, is_dummy)
        if DeviceTensors.active is not None:
            DeviceTensors.active.mark(batch)
        return batch, dummy

    trainer._prepare_sample = prepare_and_move
    host = copy.deepcopy(sample)  # never marked (another run may hold ``sample`` on the device)

    def step() -> None:
        with metrics.aggregate("train_inner"):
            trainer.train_step([copy.deepcopy(host)])

    return Run(name, f"{type(trainer).__name__}.train_step, {model_args}", step, model, sample, host_batch=True)


def bare_run(name: str, model: torch.nn.Module, sample: dict, lr: float = 5e-4) -> Run:
    """``model`` (in training mode) trained by a bare PyTorch loop on ``sample``: forward, mean
    cross-entropy over the non-padding targets, backward, ``torch.optim.Adam`` step (fairseq's
    lr), ``zero_grad``."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    net_input, target = sample["net_input"], sample["target"].view(-1)
    pad = model.decoder.dictionary.pad()
    model.train()

    def step() -> None:
        logits = model(**net_input)[0]
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target, ignore_index=pad)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return Run(name, "the ts_lm model object: forward, cross-entropy, backward, torch.optim.Adam, zero_grad",
               step, model, sample)


def build_runs(model_args: str, stock_args: str, vocab: int, sample_shape: Tuple[int, int]) -> List[Run]:
    """The three runs of the module docstring, ``ts_lm``, ``stock`` and ``bare``, on one batch."""
    ts = fairseq_run("ts_lm", model_args, vocab, sample_shape)
    stock = fairseq_run("stock", stock_args, vocab, sample_shape, ts.sample)
    return [ts, stock, bare_run("bare", ts.model, ts.sample)]


def warm_up(run: Run, device: DeviceTensors, steps: int) -> None:
    """``steps`` (>= 1) steps of ``run``; ``device`` follows the first, which builds the optimizer state."""
    device.mark([run.model.parameters(), run.model.buffers(), [] if run.host_batch else run.sample])
    with device:
        run.step()
    for _ in range(steps - 1):
        run.step()


def count(run: Run, device: DeviceTensors) -> Tuple[OpCounter, SyncCounter]:
    """The aten ops and host syncs of one step of ``run`` (after :func:`warm_up`)."""
    with OpCounter() as ops, SyncCounter(device) as syncs:
        run.step()
    return ops, syncs


def time_rounds(runs: List[Run], steps: int, repeats: int) -> Dict[str, List[float]]:
    """Per run, each round's median step in ms; the runs' order rotates from round to round."""
    rounds: Dict[str, List[float]] = {run.name: [] for run in runs}
    for r in range(repeats):
        for run in runs[r % len(runs):] + runs[:r % len(runs)]:
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                run.step()
                times.append(time.perf_counter() - start)
            rounds[run.name].append(1e3 * statistics.median(times))
    return rounds


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = build_runs(args.model_args, args.stock_args, args.vocab, (args.batch_size, args.tokens_per_sample))
    device = DeviceTensors()
    for run in runs:
        warm_up(run, device, args.warmup)
    counts = {run.name: count(run, device) for run in runs}
    rounds = time_rounds(runs, args.steps, args.repeats)

    params = {run.name: sum(p.numel() for p in run.model.parameters()) for run in runs}
    print(f"# {now()} | load {load_average()} | torch {torch.__version__}, {torch.get_num_threads()} thread(s) | "
          f"batch {args.batch_size}x{args.tokens_per_sample}, {len(runs[0].model.decoder.dictionary)} symbols | "
          f"{args.warmup} warm-up + {args.repeats} rounds x {args.steps} steps each")
    print("| step | what | params | ms/step (median of rounds) | aten ops/step | host syncs/step |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        ops, syncs = counts[run.name]
        print(f"| {run.name} | {run.what} | {params[run.name]:,} | {statistics.median(rounds[run.name]):.2f} | "
              f"{ops.total} | {syncs.total} |")
    ratios = {}
    for other in ("bare", "stock"):
        per_round = [t / o for t, o in zip(rounds["ts_lm"], rounds[other])]
        ratios[other] = statistics.median(per_round)
        print(f"ts_lm / {other} per round: {', '.join(f'{x:.2f}' for x in per_round)}")
    for run in runs:
        syncs = counts[run.name][1]
        print(f"host syncs of {run.name} ({syncs.total}), by call site:")
        for (what_synced, site), n in syncs.sites.most_common(TOP_SITES):
            print(f"  {n:3d} x {what_synced:32s} {site}")
    verdict = "met" if ratios["bare"] <= TARGET else "not met"
    print(f"RESULT ts_lm/bare {ratios['bare']:.2f} (target <= {TARGET}: {verdict}), ts_lm/stock {ratios['stock']:.2f}; "
          f"ms/step ts_lm {statistics.median(rounds['ts_lm']):.2f}, stock {statistics.median(rounds['stock']):.2f}, "
          f"bare {statistics.median(rounds['bare']):.2f}; syncs/step {counts['ts_lm'][1].total}/"
          f"{counts['stock'][1].total}/{counts['bare'][1].total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
