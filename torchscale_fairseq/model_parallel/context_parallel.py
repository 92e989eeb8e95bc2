"""Context parallelism: each sequence split over the ``C`` ranks of a context-parallel group,
causal self-attention by a ring exchange of keys and values (Liu et al. 2023, "Ring Attention";
Megatron-core / Transformer Engine's ``AttnFuncWithCPAndKVP2P``).

Causal load balance: the sequence is cut into ``2C`` chunks of ``n`` tokens and rank ``r`` holds
chunks ``r`` and ``2C-1-r`` (:func:`context_parallel_indices`), so every rank holds as many early
(cheap) as late (expensive) queries. The ring: at step ``s`` rank ``r`` holds the keys/values of
rank ``j = (r - s) mod C`` and sends them on to ``r + 1`` while it attends to them:

- ``s = 0`` (``j = r``): its own chunks, causal (the local order is the global order);
- ``j < r``: all ``2n`` queries see chunk ``j`` (the first half of the block), unmasked;
- ``j > r``: only the second half of the queries (chunk ``2C-1-r``) sees both chunks, unmasked;

so every step after the first costs ``2n x n`` scores. The partial outputs merge by their
log-sum-exps: ``lse = log(exp(lse_a) + exp(lse_b))``, ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``.
Document masks (``--document-masking``): every rank of the group reads the same batch, so each
knows the document ids of every chunk; a step's block also masks query ``i`` / key ``j`` of
different documents (:func:`~torchscale_fairseq.modules.document_mask.allowed_keys`). A query with
no key left in a block contributes ``(o, lse) = (0, -inf)``, which the merge weighs by ``exp(-inf) = 0``.
Backward (hand-written, FlashAttention-2's block gradients with the final ``lse``) runs the ring
again, the key/value gradients travelling with their keys/values and one more step home.
Bytes each rank sends per attention call (``B`` batch, ``h`` local heads, ``d`` head dim, ``T``
global length, ``e`` bytes per element): forward ``(C-1) 2 B h (T/C) d e``; backward the same for
keys/values plus ``C 2 B h (T/C) d 4`` for their fp32 gradients.

Why a ring, not an all-to-all over heads (DeepSpeed-Ulysses): the ring needs no head count
divisible by ``C`` (it composes with tensor parallelism, which already divides the heads), each
step's transfer overlaps that step's block computation, and its message size does not grow with
``C``; Ulysses moves fewer bytes at large ``C`` but caps ``C`` at the local head count.

Each step's sends and receives are posted together in one ``batch_isend_irecv`` (NCCL-safe: two
neighbours that send then receive could otherwise wait on each other), on the group passed in.
:func:`gathered_causal_attention` is the plain PyTorch reference (full attention on the gathered
sequence) the tests compare with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.modules.document_mask import allowed_keys


@dataclass(frozen=True)
class ContextParallelGroup:
    """A context-parallel group as the ring uses it: the process group, its global ranks in ring
    order, and this rank's position (chunks ``rank`` and ``2 size - 1 - rank``)."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)


def sequence_multiple(context_size: int, tensor_size: int, sequence_parallel: bool) -> int:
    """What a batch's length is padded to under context parallelism: ``2 C`` equal chunks, each
    rank's ``2 T_seq / (2 C)`` tokens a multiple of the tensor-parallel size under ``--sequence-parallel``."""
    return 2 * context_size * (tensor_size if sequence_parallel else 1)


def context_parallel_indices(length: int, size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global token indices rank ``rank`` of ``size`` holds: chunks ``rank`` and
    ``2 size - 1 - rank`` of ``2 size`` equal chunks of ``0 ... length - 1``."""
    if length % (2 * size) != 0:
        raise TsConfigError(
            f"a sequence of {length} tokens does not split into {2 * size} equal chunks (--context-parallel-size "
            f"{size}): pad it to a multiple of {2 * size}"
        )
    n = length // (2 * size)
    first = torch.arange(rank * n, (rank + 1) * n, device=device)
    second = torch.arange((2 * size - 1 - rank) * n, (2 * size - rank) * n, device=device)
    return torch.cat([first, second])


def pad_to_multiple(tokens: torch.Tensor, multiple: int, pad: int) -> torch.Tensor:
    """``tokens`` ``(B, T, ...)`` right-padded with ``pad`` along dim 1 to a multiple of ``multiple``."""
    extra = -tokens.size(1) % multiple
    if not extra:
        return tokens
    return torch.cat([tokens, tokens.new_full((tokens.size(0), extra, *tokens.shape[2:]), pad)], dim=1)


def gathered_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: causal attention on the whole ``(B, h, T, d)`` sequence (within documents given
    ``document_ids`` ``(B, T)``)."""
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    length = q.size(2)
    allowed = allowed_keys(length, length, True, q.device, document_ids=document_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (a query without keys) as ``0``, so that ``exp(-inf - lse)`` is ``0``, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``q k^T scale``, ``-inf`` where not ``allowed`` (boolean, broadcast to the scores; ``None``: all keys)."""
    scores = (q @ k.transpose(-2, -1)) * scale
    return scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(S) v, logsumexp(S))`` of ``S = q k^T scale`` over the ``allowed`` keys, in fp32
    (``(0, -inf)`` for a query without keys)."""
    scores = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - _finite(lse).unsqueeze(-1)) @ v, lse


def _block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, allowed: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, ...]:
    """Gradients of one block given the final ``lse`` and ``delta = rowsum(dout * out)``:
    ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - delta)``, ``dQ = dS K s``, ``dK = dS^T Q s``."""
    p = torch.exp(_scores(q, k, allowed, scale) - _finite(lse).unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge a block's partial result into ``(out, lse)`` in place by their log-sum-exps."""
    new = torch.logaddexp(lse, block_lse)
    finite = _finite(new)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1)).add_(torch.exp(block_lse - finite).unsqueeze(-1) * block_out)
    lse.copy_(new)


def _block_allowed(document_ids: torch.Tensor | None, n: int, size: int, rank: int, source: int,
                   device: torch.device) -> torch.Tensor | None:
    """Which keys of the block a ring step computes (this rank's ``2n`` queries against rank ``source``'s
    chunks, cut as in the module docstring) each query may attend (``None``: all): causal at
    ``source == rank`` and, given the whole sequence's ``document_ids`` ``(B, T)``, within its document."""
    if document_ids is None:
        return allowed_keys(2 * n, 2 * n, True, device) if source == rank else None
    queries = document_ids[:, context_parallel_indices(document_ids.size(1), size, rank, device)]
    if source == rank:
        return allowed_keys(2 * n, 2 * n, True, device, document_ids=queries)
    keys = document_ids[:, context_parallel_indices(document_ids.size(1), size, source, device)]
    if source < rank:
        return queries[:, None, :, None] == keys[:, None, None, :n]
    return queries[:, None, n:, None] == keys[:, None, None, :]


def _ring_step(outgoing: Sequence[torch.Tensor], group: dist.ProcessGroup, ranks: Sequence[int],
               rank: int) -> tuple[list, list[torch.Tensor]]:
    """Post sending ``outgoing`` to the next rank of the ring and receiving the previous rank's
    (same shapes) in one ``batch_isend_irecv``; return the requests and the receive buffers."""
    size = len(ranks)
    nxt, prev = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
    incoming = [torch.empty_like(t) for t in outgoing]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in outgoing]
    ops += [dist.P2POp(dist.irecv, t, prev, group) for t in incoming]
    return dist.batch_isend_irecv(ops), incoming


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    """Causal ring attention on the load-balanced local sequence (module docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                ranks: tuple[int, ...], document_ids: torch.Tensor | None) -> torch.Tensor:
        size, rank = len(ranks), ranks.index(dist.get_rank())
        compute = torch.promote_types(q.dtype, torch.float32)
        scale = q.size(-1) ** -0.5
        n = q.size(2) // 2
        qc = q.to(compute)
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for step in range(size):
            pending = _ring_step([kv], group, ranks, rank) if step < size - 1 else None
            source = (rank - step) % size
            kc, vc = kv.to(compute).unbind(0)
            allowed = _block_allowed(document_ids, n, size, rank, source, q.device)
            if step == 0:
                out, lse = _block_forward(qc, kc, vc, allowed, scale)
            elif source < rank:
                _merge(out, lse, *_block_forward(qc, kc[:, :, :n], vc[:, :, :n], allowed, scale))
            else:
                _merge(out[:, :, n:], lse[:, :, n:], *_block_forward(qc[:, :, n:], kc, vc, allowed, scale))
            if pending is not None:
                _wait(pending[0])
                kv = pending[1][0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.ranks, ctx.document_ids = group, ranks, document_ids
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, ranks = ctx.group, ctx.ranks
        size, rank = len(ranks), ranks.index(dist.get_rank())
        compute = out.dtype
        scale = q.size(-1) ** -0.5
        n = q.size(2) // 2
        qc, do = q.to(compute), dout.to(compute)
        delta = (do * out).sum(-1)
        dq = torch.zeros_like(qc)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=compute, device=kv.device)
        for step in range(size):
            source = (rank - step) % size
            kc, vc = kv.to(compute).unbind(0)
            allowed = _block_allowed(ctx.document_ids, n, size, rank, source, q.device)
            if step == 0:
                gq, gk, gv = _block_backward(qc, kc, vc, do, lse, delta, allowed, scale)
                dq += gq
                dkv[0] += gk
                dkv[1] += gv
            elif source < rank:
                gq, gk, gv = _block_backward(qc, kc[:, :, :n], vc[:, :, :n], do, lse, delta, allowed, scale)
                dq += gq
                dkv[0, :, :, :n] += gk
                dkv[1, :, :, :n] += gv
            else:
                gq, gk, gv = _block_backward(qc[:, :, n:], kc, vc, do[:, :, n:], lse[:, :, n:], delta[:, :, n:],
                                             allowed, scale)
                dq[:, :, n:] += gq
                dkv[0] += gk
                dkv[1] += gv
            # the key/value gradients travel with their keys/values; after the last step, home
            requests, incoming = _ring_step([kv, dkv] if step < size - 1 else [dkv], group, ranks, rank)
            _wait(requests)
            if step < size - 1:
                kv, dkv = incoming
            else:
                dkv = incoming[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                   ranks: Sequence[int], document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's ``(B, h, 2n, d)`` queries, keys and values (chunks ``r`` and
    ``2C-1-r`` of the sequence, :func:`context_parallel_indices`) over the whole sequence held by
    the ``C`` ranks of ``group`` (global ``ranks``, in ring order), within documents given the whole
    sequence's ``document_ids`` ``(B, 2nC)``; ``group`` ``None``: plain causal attention."""
    if group is None or len(ranks) == 1:
        return gathered_causal_attention(q, k, v, document_ids)
    return _RingAttention.apply(q, k, v, group, tuple(ranks), document_ids)
