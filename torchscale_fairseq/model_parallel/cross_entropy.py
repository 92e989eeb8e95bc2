"""Vocabulary-parallel cross-entropy (Megatron-LM section 3), fed directly by the
vocabulary-sharded output layer.

Rank ``r`` holds logits ``z_j`` for its slice ``[r V_p/N, (r+1) V_p/N)`` of the padded
vocabulary ``V_p``; entries ``j >= V`` (padding) are excluded everywhere. Only per-token
scalars cross ranks: ``m = max_j z_j`` (one all-reduce), then ``S = sum_j exp(z_j - m)``,
the target logit ``z_t - m`` and ``sum_j (z_j - m)`` stacked in one all-reduce, so that

- ``nll = log S - (z_t - m)``  (``-log p_t``),
- ``smooth = V log S - sum_j (z_j - m)``  (``-sum_j log p_j`` over the real vocabulary,
  for label smoothing over the global vocabulary),
- ``target_is_max = z_t == m`` (accuracy, without a global argmax).

Backward needs no communication: ``d nll/d z_j = p_j - [j = t]`` and
``d smooth/d z_j = V p_j - [j < V]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from torchscale_fairseq.model_parallel.process_groups import group_rank, group_size


class VocabParallelLoss(NamedTuple):
    """Per-token ``-log p_t``, ``-sum_j log p_j`` and whether ``t`` is the argmax."""

    nll: torch.Tensor
    smooth: torch.Tensor
    target_is_max: torch.Tensor


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None):
        local_v = logits.size(-1)
        start = group_rank(group) * local_v
        valid = torch.arange(start, start + local_v, device=logits.device) < vocab_size
        z = logits.float()
        if not bool(valid.all()):
            z = z.masked_fill(~valid, float("-inf"))
        m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted = z - m.unsqueeze(-1)
        exp = shifted.exp()
        local_t = target - start
        in_range = (local_t >= 0) & (local_t < local_v)
        picked = shifted.gather(-1, local_t.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
        sums = torch.stack(
            [exp.sum(-1), picked.masked_fill(~in_range, 0.0), shifted.masked_fill(~valid, 0.0).sum(-1)]
        )
        sum_exp, target_shifted, sum_shifted = _all_reduce(sums, dist.ReduceOp.SUM, group).unbind(0)
        log_z = sum_exp.log()
        nll = log_z - target_shifted
        smooth = vocab_size * log_z - sum_shifted
        probs = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, local_t, in_range, valid)
        ctx.vocab_size = vocab_size
        ctx.logits_dtype = logits.dtype
        target_is_max = target_shifted == 0
        ctx.mark_non_differentiable(target_is_max)
        return nll, smooth, target_is_max

    @staticmethod
    def backward(ctx, grad_nll: torch.Tensor, grad_smooth: torch.Tensor, _grad_max):
        probs, local_t, in_range, valid = ctx.saved_tensors
        grad_nll = grad_nll.float().unsqueeze(-1)
        grad_smooth = grad_smooth.float().unsqueeze(-1)
        grad = probs * (grad_nll + ctx.vocab_size * grad_smooth)
        grad = grad - valid.to(grad.dtype) * grad_smooth
        onehot = torch.zeros_like(grad).scatter_(-1, local_t.clamp(0, grad.size(-1) - 1).unsqueeze(-1), 1.0)
        grad = grad - onehot * in_range.unsqueeze(-1).to(grad.dtype) * grad_nll
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, tp_group: dist.ProcessGroup | None
) -> VocabParallelLoss:
    """Per-token losses of this rank's logit slice ``logits`` (``(..., V_p / N)``, N ranks in
    ``tp_group``) against global ``target`` ids (``(...)``); ``vocab_size`` = the real ``V``."""
    return VocabParallelLoss(*_VocabParallelCrossEntropy.apply(logits, target, vocab_size, tp_group))


def label_smoothed_loss(
    loss: VocabParallelLoss, target: torch.Tensor, epsilon: float, vocab_size: int, ignore_index: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed ``(loss, nll_loss)`` as fairseq's ``label_smoothed_nll_loss``:
    ``(1 - eps - eps_i) nll + eps_i smooth`` with ``eps_i = eps / (V - 1)``, pads masked."""
    nll, smooth = loss.nll, loss.smooth
    if ignore_index is not None:
        pad = target.eq(ignore_index)
        nll, smooth = nll.masked_fill(pad, 0.0), smooth.masked_fill(pad, 0.0)
    nll, smooth = nll.sum(), smooth.sum()
    eps_i = epsilon / (vocab_size - 1)
    return (1.0 - epsilon - eps_i) * nll + eps_i * smooth, nll
