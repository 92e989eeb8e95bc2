"""The output layer and the cross-entropy in one step that never holds ``N x V`` logits
(fused linear + cross-entropy, as Liger-Kernel's and Apple's Cut Cross-Entropy), also
vocabulary-parallel (Megatron-LM section 3).

For ``N`` rows of features ``h`` (``N x d``), this rank's output weight ``W_r``
(``V_p / n x d``, ``n`` tensor-parallel ranks, padded entries ``j >= V`` excluded) and
targets ``t``, the loss is

    L = sum_{i: t_i != ignore} ( log sum_j exp(z_ij) - z_{i t_i} ),   z = h W^T

computed ``chunk`` rows at a time: the chunk's logits ``z_c = h_c W_r^T`` (in ``h``'s dtype,
then fp32), their row maxima and sums (two all-reduces of per-row scalars across ranks, as
:mod:`.cross_entropy`), and at once the gradients of the chunk,

    g_c = (softmax(z_c) - onehot(t_c)) * keep_c,   dh_c = g_c W_r,   dW_r += g_c^T h_c,

so only one chunk's ``chunk x V_p / n`` logits exist at a time (compiled: the last chunk is padded
to ``chunk`` rows that count for nothing, one graph shape). Backward multiplies the kept
``dh`` and ``dW_r`` by the incoming scalar gradient. The per-chunk softmax and gradient are
:func:`chunk_loss_and_grad`, plain PyTorch; with ``compiled`` (``--ts-compile``) they run
through ``torch.compile`` (one fused kernel instead of about ten passes over the chunk; at
tensor-parallel size 1: the collectives stay eager). Under autocast (``--amp``) the GEMMs run in
autocast's dtype; the weight's gradient stays fp32 until backward scales it (fp16 loss scales).
Under tensor parallelism ``dh`` is this rank's part: the caller passes ``h`` through
``copy_to_tensor_parallel_region``, whose backward sums it over the ranks.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from torchscale_fairseq.model_parallel.process_groups import group_rank, group_size


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def chunk_loss_and_grad(
    logits: torch.Tensor, local_target: torch.Tensor, in_range: torch.Tensor, keep: torch.Tensor,
    valid_columns: int, group: dist.ProcessGroup | None, with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed ``-log softmax(z)[t]`` over kept rows of one chunk, and (``with_grad``) the
    gradient ``(softmax(z) - onehot(t)) * keep`` in ``logits``' dtype. ``logits``: this rank's
    ``rows x V_r`` slice; columns from ``valid_columns`` on are padding; ``local_target``: the
    target's column on this rank (clamped into range), ``in_range``: whether it is on this
    rank; ``keep``: 1.0 for rows that count, 0.0 for ignored ones."""
    z = logits.float()
    if valid_columns < z.size(1):
        columns = torch.arange(z.size(1), device=z.device)
        z = z.masked_fill(columns >= valid_columns, float("-inf"))
    m = _all_reduce(z.amax(dim=1), dist.ReduceOp.MAX, group)
    shifted = z - m.unsqueeze(1)
    exp = shifted.exp()
    picked = shifted.gather(1, local_target.unsqueeze(1)).squeeze(1)
    picked = torch.where(in_range > 0, picked, torch.zeros_like(picked))  # not -inf * 0 on a padded column
    sums = _all_reduce(torch.stack([exp.sum(dim=1), picked]), dist.ReduceOp.SUM, group)
    sum_exp, target_shifted = sums[0], sums[1]
    loss = ((sum_exp.log() - target_shifted) * keep).sum()
    if not with_grad:
        return loss, None
    grad = exp * (keep / sum_exp).unsqueeze(1)
    grad = grad.scatter_add(1, local_target.unsqueeze(1), (-keep * in_range).unsqueeze(1))
    return loss, grad.to(logits.dtype)


@functools.cache
def _compiled_chunk_loss_and_grad():
    """One static-shape graph: every chunk it sees is ``chunk x V_r`` (the last one padded), so its
    kernels are tuned for the real size (a dynamic graph reuses kernels tuned for the first size
    seen, even from the inductor cache of another process; benchmarks/RESULTS.md, issue 43)."""
    return torch.compile(chunk_loss_and_grad, dynamic=False)


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss, with both gradients computed in forward; backward scales them (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_size, ignore_index, chunk, group, compiled):
        loss, grad_hidden, grad_weight = _loss_and_grads(
            hidden, weight, target, vocab_size, ignore_index, chunk, group, compiled, with_grad=True)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors  # the weight's in fp32 until scaled (fp16 loss scales)
        return (grad_hidden * grad_loss, (grad_weight * grad_loss).to(ctx.weight_dtype),
                None, None, None, None, None, None)


def _loss_and_grads(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab_size: int, ignore_index: int | None,
    chunk: int, group: dist.ProcessGroup | None, compiled: bool, with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The summed loss and, ``with_grad``, the gradients of ``hidden`` (its dtype) and of ``weight``
    (fp32). Under autocast the GEMMs run in autocast's dtype, as ``F.linear`` would."""
    rows, local_v = hidden.size(0), weight.size(0)
    start = group_rank(group) * local_v
    valid_columns = min(max(vocab_size - start, 0), local_v)
    # the compiled graph holds no collective: under tensor parallelism the chunks run eagerly
    step = _compiled_chunk_loss_and_grad() if compiled and group_size(group) == 1 else chunk_loss_and_grad
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if with_grad else None
    grad_weight = None
    with torch.autocast(device, enabled=False):
        w = weight.to(dtype)
        for i in range(0, rows, chunk):
            h = hidden[i:i + chunk].to(dtype)
            t = target[i:i + chunk]
            local_t = t - start
            in_range = ((local_t >= 0) & (local_t < local_v)).float()
            keep = t.ne(ignore_index).float() if ignore_index is not None else torch.ones_like(in_range)
            n = h.size(0)
            if step is not chunk_loss_and_grad and n < chunk:  # the compiled graph's one shape
                h, local_t, in_range, keep = (torch.nn.functional.pad(x, (0, 0, 0, chunk - n) if x.dim() == 2
                                                                      else (0, chunk - n))
                                              for x in (h, local_t, in_range, keep))
            chunk_loss, grad = step(torch.mm(h, w.t()), local_t.clamp(0, local_v - 1), in_range, keep,
                                    valid_columns, group, with_grad)
            loss = loss + chunk_loss
            if not with_grad:
                continue
            grad, h = grad[:n], h[:n]
            grad_hidden[i:i + n].copy_(torch.mm(grad, w))
            part = torch.mm(grad.t(), h)
            grad_weight = part.float() if grad_weight is None else grad_weight.add_(part)
    if with_grad and grad_weight is None:
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
    return loss, grad_hidden, grad_weight


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab_size: int,
    ignore_index: int | None = None, chunk: int = 4096, group: dist.ProcessGroup | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T`` (``(N, d)`` x ``(V_r, d)``, this rank's
    vocabulary slice) against global ids ``target`` (``(N,)``), rows whose target is
    ``ignore_index`` left out, ``chunk`` rows at a time (module docstring). Returns an fp32
    scalar; differentiable in ``hidden`` and ``weight``."""
    if chunk < 1:
        raise ValueError(f"chunk {chunk} must be a positive number of rows")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, target, vocab_size, ignore_index, chunk, group, compiled)
    return _loss_and_grads(hidden, weight, target, vocab_size, ignore_index, chunk, group, compiled, False)[0]
