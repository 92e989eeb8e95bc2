"""The local experts as one grouped FFN over rows sorted by expert: ``rows`` (N, d) holds
``counts[0]`` rows for local expert 0, then ``counts[1]`` for expert 1, and so on; each
group goes through its own ``fc2(act(fc1 x))`` (Sub-LN before ``fc2`` under Magneto).

Only real assignments are computed: no capacity padding. With top-2 at capacity factor 1
the padded ``(E, C, d)`` layout holds ``2T`` rows whatever the routing, and at E = 256
about a tenth of them are empty slots (experts below their capacity); a grouped GEMM
(one GEMM per expert, as Megatron-LM's ``SequentialMLP``) skips them.

On a Hopper GPU in bf16 the three GEMMs of each projection run as one grouped GEMM each
(``torch._grouped_mm``, CUTLASS: one kernel for all experts instead of one launch per expert, as
Megatron-core's ``GroupedMLP`` and TorchTitan do), once a probe on small operands with the layer's
feature sizes has checked it against the loop (:func:`grouped_mm_fits`); elsewhere, and on CPU,
where ``torch._grouped_mm`` is itself a loop of GEMMs, the loop below runs.

Each projection ``y_r = b_e + x_r W_e`` is a :class:`GroupedLinear` with backward
``dx_r = dy_r W_e^T``, ``dW_e = sum_r x_r^T dy_r``, ``db_e = sum_r dy_r`` over the rows of
expert ``e`` (zero for an expert without rows). ``dW`` is as large as the expert weights
(2 GB per step for 256 experts of 512 x 2048) and fairseq sets gradients to ``None``
every step, so without care it is a fresh allocation each step, and on CPU the
first-touch page faults of that memory cost more than the GEMM that fills it (1.4-1.8 s
per GB on the benchmark box, vs 1.1 s for the GEMM). :class:`GradBuffers` keeps the
storage of the last weight gradient and hands it out again once nothing else references
it (its storage use count is back to 1), so the gradient still reaches ``.grad`` through
autograd (hooks, accumulation and ``torch.autograd.grad`` behave as for any parameter)
but the memory stays mapped.

Under tensor parallelism (``tp_group`` of ``N`` ranks, ``--moe-expert-tensor-parallel split``)
each expert is split as the dense FFN is (Megatron-LM section 3; Megatron-core's expert
tensor parallelism): ``fc1`` by columns (``W1_e`` (d, f/N) per rank), the Sub-LN over the
split ``f`` features (statistics all-reduced), ``fc2`` by rows; the partial products
``h_r W2_e`` are all-reduced over ``tp_group`` (``g``) before the replicated bias ``b2_e`` is
added once, so an expert's output rows are whole on every rank before they travel back and
are combined (the gate gradient ``<dy_t, y_r>`` needs whole rows). The ``f`` (all-reduce of
the input gradient) is the caller's, on the tokens before they are gathered into rows
(:class:`~torchscale_fairseq.modules.moe.layer.MoELayer`). Split tensors carry
``tensor_parallel_dim`` besides the expert marks. Activation dropout on the split
activations draws from the tracker's per-rank stream, as the dense FFN does.

Expert parameters are marked with
:func:`~torchscale_fairseq.model_parallel.attributes.mark_expert` (the expert-parallel size that
finds their groups in the run's parallel context, for the gradient norm and for gradient
averaging). Each expert is initialised from its own
generator seeded with ``base + global expert id`` (``base`` drawn from the global RNG),
so an expert gets the same initial weights whatever the number of ranks (a split expert
draws its full weights and keeps its shard).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from torchscale_fairseq.model_parallel.attributes import mark_expert, mark_sharded
from torchscale_fairseq.model_parallel.layers import TensorParallelGroup, divide, sharded_normalize
from torchscale_fairseq.model_parallel.mappings import reduce_from_tensor_parallel_region
from torchscale_fairseq.model_parallel.partition import shard_tensor
from torchscale_fairseq.model_parallel.process_groups import group_rank, group_size
from torchscale_fairseq.model_parallel.random import get_rng_tracker
from torchscale_fairseq.modules.feedforward import FFNSpec, activate, check_activation

logger = logging.getLogger(__name__)


class GradBuffers:
    """One reusable gradient storage per weight name (see the module docstring)."""

    def __init__(self) -> None:
        self.storages: dict[str, torch.UntypedStorage] = {}

    def empty(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor shaped like ``like``, on the cached storage when it is free."""
        storage = self.storages.get(name)
        if (storage is None or storage.device != like.device or storage.nbytes() != like.nbytes
                or torch._C._storage_Use_Count(storage._cdata) > 1):
            out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            self.storages[name] = out.untyped_storage()
            return out
        return torch.empty(0, dtype=like.dtype, device=like.device).set_(storage, 0, like.shape)

    def __getstate__(self) -> dict:
        """A cache: copies and pickles start empty."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.storages = {}


def _groups(counts: list[int]):
    """``(expert, first row, end row)`` of every expert that has rows."""
    start = 0
    for expert, n in enumerate(counts):
        if n:
            yield expert, start, start + n
        start += n


@dataclass
class RowGroups:
    """Rows grouped by expert as ``torch._grouped_mm`` takes them, made on the device from the
    counts (no host read): ``offs`` (E,) int32 group ends, ``expert`` (N,) each row's expert
    (the last one for the rows after the groups), ``outside`` (N, 1): the row is in no group."""

    offs: torch.Tensor
    expert: torch.Tensor
    outside: torch.Tensor

    @classmethod
    def of(cls, counts: torch.Tensor, rows: int) -> "RowGroups":
        offs = torch.cumsum(counts, 0).to(torch.int32)
        expert = torch.searchsorted(offs, torch.arange(rows, device=counts.device, dtype=torch.int32), right=True)
        return cls(offs, expert.clamp(max=counts.numel() - 1), (expert >= counts.numel()).unsqueeze(1))

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the rows after the groups set to zero (``torch._grouped_mm`` leaves them undefined):
        one kernel, with no zero tensor made for it."""
        return x.masked_fill(self.outside, 0)


class GroupedLinear(torch.autograd.Function):
    """``y_r = b_e + x_r W_e`` for the rows ``r`` of expert ``e``: ``x`` (N, d_in) grouped by
    ``counts``, ``W`` (E, d_in, d_out), ``b`` (E, d_out) or ``None`` (no bias). ``grouped``: the
    GEMMs as ``torch._grouped_mm`` calls (``counts`` a list, a tensor or :class:`RowGroups`;
    rows after the groups give zero), else one per expert (``counts`` a list covering ``x``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                counts: list[int] | torch.Tensor | RowGroups, buffers: GradBuffers, name: str,
                grouped: bool = False) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.groups, ctx.buffers, ctx.name, ctx.grouped = counts, buffers, name, grouped
        if grouped:
            if not isinstance(counts, RowGroups):
                counts = RowGroups.of(torch.as_tensor(counts, device=x.device), x.size(0))
            ctx.groups = counts
            out = torch._grouped_mm(x, weight, offs=counts.offs)
            return counts.mask(out if bias is None else out + bias[counts.expert])
        out = x.new_empty(x.size(0), weight.size(2))
        for e, lo, hi in _groups(counts):
            if bias is None:
                torch.mm(x[lo:hi], weight[e], out=out[lo:hi])
            else:
                torch.addmm(bias[e], x[lo:hi], weight[e], out=out[lo:hi])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx, dw, db = _grouped_linear_backward(ctx, x, weight, grad.to(x.dtype), ctx.needs_input_grad[:3])
        return dx, dw, db, None, None, None, None


class GatherGroupedLinear(torch.autograd.Function):
    """``y_r = b_e + x_{i_r} W_e``: the grouped-GEMM :class:`GroupedLinear` on the rows ``x[index]`` of
    the tokens ``x`` (T, d_in), gathered inside the computation (a transient operand of the grouped
    GEMM) and not saved: backward gathers them again for ``dW`` and adds the rows' gradients back
    into the tokens (``dx_t = sum_{r: i_r = t} dy_r W_e^T``, one ``index_add``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                groups: RowGroups) -> torch.Tensor:
        ctx.save_for_backward(x, index, weight)
        ctx.groups, ctx.grouped = groups, True
        out = torch._grouped_mm(x.index_select(0, index), weight, offs=groups.offs)
        return groups.mask(out + bias[groups.expert])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, index, weight = ctx.saved_tensors
        need_dx, _, need_dw, need_db = ctx.needs_input_grad[:4]
        rows = x.index_select(0, index)
        drows, dw, db = _grouped_linear_backward(ctx, rows, weight, grad.to(x.dtype), (need_dx, need_dw, need_db))
        dx = torch.zeros_like(x).index_add_(0, index, drows) if need_dx else None
        return dx, None, dw, db, None


class ScatterGroupedLinear(torch.autograd.Function):
    """``out_t = sum_{r: i_r = t} g_r (b_e + h_r W_e)`` (T = ``num_tokens`` rows): the grouped-GEMM
    :class:`GroupedLinear` and the weighted combine as one scatter (``index_add``), with no weighted
    copy of the rows. Backward: ``dg_r = <dout_{i_r}, y_r>``, ``dy_r = g_r dout_{i_r}``, then as
    :class:`GroupedLinear`."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, index: torch.Tensor,
                gate: torch.Tensor, num_tokens: int, groups: RowGroups) -> torch.Tensor:
        y = groups.mask(torch._grouped_mm(h, weight, offs=groups.offs) + bias[groups.expert])
        ctx.save_for_backward(h, weight, y, index, gate)
        ctx.groups, ctx.grouped = groups, True
        # out of place: an in-place index_add_ as the output reaches a compiled backward as zero gradients (torch 2.11)
        return y.new_zeros(num_tokens, y.size(1)).index_add(0, index, y * gate.unsqueeze(1))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        h, weight, y, index, gate = ctx.saved_tensors
        rows = grad.to(y.dtype).index_select(0, index)
        dgate = (rows * y).sum(1) if ctx.needs_input_grad[4] else None
        dy = rows * gate.unsqueeze(1)
        dh, dw, db = _grouped_linear_backward(ctx, h, weight, dy, ctx.needs_input_grad[:3])
        return dh, dw, db, None, dgate, None, None


def _grouped_linear_backward(ctx, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                             needs: tuple[bool, ...]) -> tuple:
    """``(dx, dW, db)`` of :class:`GroupedLinear` (``ctx``: its groups, buffers, name and mode)."""
    need_dx, need_dw, need_db = needs
    if ctx.grouped:  # the rows after the groups are in no GEMM: their gradient is never read
        groups = ctx.groups
        grad = grad.contiguous()  # torch._grouped_mm refuses an expanded gradient (a sum's)
        dx = groups.mask(torch._grouped_mm(grad, weight.transpose(1, 2), offs=groups.offs)) if need_dx else None
        dw = torch._grouped_mm(x.t(), grad, offs=groups.offs) if need_dw else None  # empty groups: zero
        db = _sum_rows_by_expert(grad, groups) if need_db else None
        return dx, dw, db
    dx = x.new_empty(x.shape) if need_dx else None
    dw = ctx.buffers.empty(ctx.name, weight) if need_dw else None
    db = grad.new_zeros(weight.size(0), weight.size(2)) if need_db else None
    if dw is not None and 0 in ctx.groups:
        dw.zero_()
    for e, lo, hi in _groups(ctx.groups):
        if dx is not None:
            torch.mm(grad[lo:hi], weight[e].t(), out=dx[lo:hi])
        if dw is not None:
            torch.mm(x[lo:hi].t(), grad[lo:hi], out=dw[e])
        if db is not None:
            torch.sum(grad[lo:hi], 0, out=db[e])
    return dx, dw, db


def _sum_rows_by_expert(grad: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """``db_e = 1^T dY_e``, the rows of expert ``e`` summed as one grouped GEMM (the rows after the groups in none):
    fp32 accumulators rounded once, as ``torch.sum`` in the loop, with no atomic adds (the same sum on every run)."""
    ones = grad.new_ones(grad.size(0), 8)[:, :1]  # one column, rows 8 elements apart: strides of 16 bytes or more
    return torch._grouped_mm(ones.t(), grad, offs=groups.offs).view(-1, grad.size(1))  # (E, 1, d) -> contiguous (E, d)


_GROUPED_MM_PROBES: dict[tuple, bool] = {}


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :class:`GroupedLinear` runs ``torch._grouped_mm`` for these operands: a CUDA device
    of compute capability >= 9.0 (Hopper: CUTLASS grouped GEMM), bf16, 16-byte rows (``d_in``,
    ``d_out`` multiples of 8), and a probe with those feature sizes (three experts, one without
    rows) equal to the loop in forward and backward; a probe that fails says so once and the loop runs."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and weight.size(1) % 8 == 0 and weight.size(2) % 8 == 0):
        return False
    key = (x.device, weight.size(1), weight.size(2))
    if key not in _GROUPED_MM_PROBES:
        _GROUPED_MM_PROBES[key] = _probe_grouped_mm(x.device, weight.size(1), weight.size(2))
    return _GROUPED_MM_PROBES[key]


def _probe_grouped_mm(device: torch.device, d_in: int, d_out: int) -> bool:
    counts, gen = [16, 0, 32], torch.Generator(device=device).manual_seed(0)
    operands = [torch.randn(*shape, device=device, generator=gen, dtype=torch.bfloat16, requires_grad=True)
                for shape in ((sum(counts), d_in), (3, d_in, d_out), (3, d_out))]
    grad = torch.randn(sum(counts), d_out, device=device, generator=gen, dtype=torch.bfloat16)
    results = []
    try:
        for grouped in (True, False):
            out = GroupedLinear.apply(*operands, counts, GradBuffers(), "probe", grouped)
            results.append([out, *torch.autograd.grad(out, operands, grad)])
    except (RuntimeError, NotImplementedError) as err:
        logger.warning("torch._grouped_mm refused the expert GEMMs (%s): one GEMM per expert instead",
                       str(err).splitlines()[0])
        return False
    if all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())
           for a, b in zip(*results)):
        return True
    logger.warning("torch._grouped_mm differs from one GEMM per expert on this device: one GEMM per expert instead")
    return False


class GroupedAffine(torch.autograd.Function):
    """``y_r = x_r * w_e + b_e`` for the rows ``r`` of expert ``e`` (the Sub-LN affine), without
    materialising per-row copies of ``w`` and ``b``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        out = x.new_empty(x.shape)
        for e, lo, hi in _groups(counts):
            torch.addcmul(bias[e], x[lo:hi], weight[e], out=out[lo:hi])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx = grad.new_empty(grad.shape)
        dw = grad.new_zeros(weight.shape)
        db = grad.new_zeros(weight.shape)
        for e, lo, hi in _groups(ctx.counts):
            torch.mul(grad[lo:hi], weight[e], out=dx[lo:hi])
            torch.sum(grad[lo:hi] * x[lo:hi], 0, out=dw[e])
            torch.sum(grad[lo:hi], 0, out=db[e])
        return dx, dw, db, None


class GroupedBias(torch.autograd.Function):
    """``y_r = x_r + b_e`` for the rows ``r`` of expert ``e`` (the row-parallel bias, added once
    after the all-reduce); backward ``dx = dy``, ``db_e = sum_r dy_r``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ctx.counts, ctx.shape = counts, bias.shape
        out = x.clone()
        for e, lo, hi in _groups(counts):
            out[lo:hi] += bias[e]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        db = grad.new_zeros(ctx.shape)
        for e, lo, hi in _groups(ctx.counts):
            torch.sum(grad[lo:hi], 0, out=db[e])
        return grad, db, None


class GroupedExperts(nn.Module):
    def __init__(self, spec: FFNSpec, *, num_local: int, first_expert: int = 0,
                 tp_group: TensorParallelGroup = None) -> None:
        """Experts ``first_expert .. first_expert + num_local - 1``, each an FFN of ``spec``;
        ``tp_group``: the tensor-parallel group each expert is split over (``None``: whole)."""
        super().__init__()
        check_activation(spec.activation)
        embed_dim, ffn_dim = spec.embed_dim, spec.ffn_dim
        self.activation = spec.activation
        self.activation_dropout = spec.activation_dropout
        self.layernorm_eps = spec.layernorm_eps
        self.ffn_dim = ffn_dim
        self.tp_group = tp_group
        n, rank = group_size(tp_group), group_rank(tp_group)
        shard = divide(ffn_dim, n, "FFN dimension of the experts")
        parts = 2 if spec.activation == "swiglu" else 1
        self.fc1_weight = nn.Parameter(torch.empty(num_local, embed_dim, parts * shard))
        self.fc1_bias = nn.Parameter(torch.zeros(num_local, parts * shard))
        self.fc2_weight = nn.Parameter(torch.empty(num_local, shard, embed_dim))
        self.fc2_bias = nn.Parameter(torch.zeros(num_local, embed_dim))
        self.ln_weight = nn.Parameter(torch.ones(num_local, shard)) if spec.subln else None
        self.ln_bias = nn.Parameter(torch.zeros(num_local, shard)) if spec.subln else None
        self.grad_buffers = GradBuffers()
        self.grouped_mm: bool | None = None  # None: where grouped_mm_fits; True / False: always / never
        # every draw on the CPU (the base from the CPU default generator, the experts from CPU
        # generators), copied to the parameters' device: the same weights whatever the default device
        base = int(torch.randint(0, 2**31 - 1, (), device="cpu").item())
        std1 = spec.gain * math.sqrt(2.0 / (embed_dim + ffn_dim))
        with torch.no_grad():
            for i in range(num_local):
                g = torch.Generator().manual_seed(base + first_expert + i)
                fc1 = torch.randn(embed_dim, parts * ffn_dim, generator=g, device="cpu") * std1
                fc2 = torch.randn(ffn_dim, embed_dim, generator=g, device="cpu") * std1
                self.fc1_weight[i].copy_(shard_tensor(fc1, 1, parts, rank, n))
                self.fc2_weight[i].copy_(shard_tensor(fc2, 0, 1, rank, n))
        if n > 1:
            # split dimensions of the stacked (expert, ...) tensors; fc2_bias is replicated
            mark_sharded(self.fc1_weight, 2, parts)
            mark_sharded(self.fc1_bias, 1, parts)
            mark_sharded(self.fc2_weight, 1)
            for p in (self.ln_weight, self.ln_bias):
                if p is not None:
                    mark_sharded(p, 1)

    def mark_expert_parallel(self, expert_parallel_size: int) -> None:
        """Tag every parameter as experts spread over all-to-all groups of ``expert_parallel_size`` ranks."""
        for p in self.parameters():
            mark_expert(p, expert_parallel_size)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """``rows`` (N, d) grouped by local expert, ``counts[e]`` rows for expert ``e``, then
        rows for no expert, which come back zero. Grouped GEMMs take the counts on the device;
        the loop reads them on the host (given as a list: already read)."""
        if len(counts) != self.fc1_weight.size(0):
            raise ValueError(f"counts for {len(counts)} experts, but {self.fc1_weight.size(0)} local experts")
        fc1, fc2 = self.fc1_weight.to(rows.dtype), self.fc2_weight.to(rows.dtype)
        grouped = self._grouped(rows, fc1, fc2)
        if grouped:
            return self._forward(rows, RowGroups.of(torch.as_tensor(counts, device=rows.device), rows.size(0)),
                                 fc1, fc2, True)
        sizes = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        total = sum(sizes)
        if total > rows.size(0):
            raise ValueError(f"counts {sizes} ask for {total} rows, but {rows.size(0)} were given")
        out = self._forward(rows[:total], sizes, fc1, fc2, False)
        return out if total == rows.size(0) else torch.cat([out, out.new_zeros(rows.size(0) - total, out.size(1))])

    def combine(self, tokens: torch.Tensor, index: torch.Tensor, gate: torch.Tensor,
                groups: RowGroups) -> torch.Tensor:
        """``out_t = sum_{r: index_r = t} gate_r expert_{e_r}(tokens_t)`` (T, d) for rows grouped by expert
        (``groups``: each expert's rows, then rows for no expert, gate 0) with grouped GEMMs: the
        gather inside fc1 (:class:`GatherGroupedLinear`) and the combine inside fc2
        (:class:`ScatterGroupedLinear`), no permuted copy of the tokens and no weighted copy of the
        rows. Whole experts only (no tensor-parallel split)."""
        if group_size(self.tp_group) > 1:
            raise ValueError("GroupedExperts.combine runs whole experts: split experts go through forward()")
        fc1, fc2 = self.fc1_weight.to(tokens.dtype), self.fc2_weight.to(tokens.dtype)
        h = GatherGroupedLinear.apply(tokens, index, fc1, self.fc1_bias.to(tokens.dtype), groups)
        h = self._hidden(h, groups, True)
        return ScatterGroupedLinear.apply(h, fc2, self.fc2_bias.to(h.dtype), index, gate.to(h.dtype), tokens.size(0),
                                          groups)

    def runs_grouped(self, rows: torch.Tensor) -> bool:
        """Whether the GEMMs of ``rows`` (their device and dtype) run as ``torch._grouped_mm``."""
        fc1, fc2 = self.fc1_weight.to(rows.dtype), self.fc2_weight.to(rows.dtype)
        return self._grouped(rows, fc1, fc2)

    def _grouped(self, rows: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> bool:
        if self.grouped_mm is not None:
            return self.grouped_mm
        return grouped_mm_fits(rows, fc1) and grouped_mm_fits(rows, fc2)

    def _hidden(self, h: torch.Tensor, groups: RowGroups | list[int], grouped: bool) -> torch.Tensor:
        """Activation, activation dropout and Sub-LN between the two projections."""
        h = activate(h, self.activation)
        split = group_size(self.tp_group) > 1
        if self.activation_dropout > 0 and self.training:
            with get_rng_tracker().fork() if split else contextlib.nullcontext():
                h = F.dropout(h, self.activation_dropout, training=True)
        if self.ln_weight is not None:
            h = sharded_normalize(h, self.ffn_dim, self.layernorm_eps, self.tp_group)
            w, b = self.ln_weight.to(h.dtype), self.ln_bias.to(h.dtype)
            h = (groups.mask(h * w[groups.expert] + b[groups.expert]) if grouped
                 else GroupedAffine.apply(h, w, b, groups))
        return h

    def _forward(self, rows: torch.Tensor, groups: RowGroups | list[int], fc1: torch.Tensor, fc2: torch.Tensor,
                 grouped: bool) -> torch.Tensor:
        h = GroupedLinear.apply(rows, fc1, self.fc1_bias.to(rows.dtype), groups, self.grad_buffers, "fc1", grouped)
        h = self._hidden(h, groups, grouped)
        split = group_size(self.tp_group) > 1
        if not split:
            return GroupedLinear.apply(h, fc2, self.fc2_bias.to(h.dtype), groups, self.grad_buffers, "fc2", grouped)
        partial = GroupedLinear.apply(h, fc2, None, groups, self.grad_buffers, "fc2", grouped)
        whole = reduce_from_tensor_parallel_region(partial, self.tp_group)
        bias = self.fc2_bias.to(h.dtype)
        return groups.mask(whole + bias[groups.expert]) if grouped else GroupedBias.apply(whole, bias, groups)
