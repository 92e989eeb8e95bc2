"""Context parallelism's ring attention on CUDA tensors, in one process.

One GPU holds no two NCCL ranks, and gloo has no point-to-point transfers of CUDA tensors, so the
``C`` ranks of a ring run as ``C`` threads of this process, each running the ring's own forward and
hand-written backward (``_RingAttention.forward`` / ``.backward`` of
:mod:`torchscale_fairseq.model_parallel.context_parallel`, called directly: the autograd engine's
one worker thread per device would serialise ranks that wait on each other) on its chunks
``r`` and ``2C-1-r`` of the sequence. Only the transfer is replaced: ``_ring_step`` hands the
outgoing tensors (copied) to the next thread's mailbox, every tensor staying on the device, and
the rank is the thread's. The gathered outputs and the query, key and value gradients equal
causal SDPA on the whole sequence and its autograd gradients (fp32 inputs: 2e-4; bf16: against
SDPA on the same values in fp32, bf16's rounding), and the bytes each rank sends equal the
module docstring's formula."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from torchscale_fairseq.model_parallel import context_parallel as cp

pytestmark = pytest.mark.gpu


class _Ctx(SimpleNamespace):
    """What ``_RingAttention`` uses of autograd's ``ctx``."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


class _ThreadRing:
    """``C`` ranks as threads: each rank's global rank, and one mailbox per rank for ``_ring_step``."""

    def __init__(self, size: int) -> None:
        self.size, self.local = size, threading.local()
        self.mailboxes = [queue.Queue() for _ in range(size)]
        self.sent_bytes = [0] * size

    def get_rank(self, group=None) -> int:
        return self.local.rank

    def ring_step(self, outgoing, group, ranks, rank):
        nxt, mine = (rank + 1) % self.size, self.mailboxes[rank]
        self.mailboxes[nxt].put([t.clone() for t in outgoing])
        self.sent_bytes[rank] += sum(t.numel() * t.element_size() for t in outgoing)
        incoming: list[torch.Tensor] = []
        return [SimpleNamespace(wait=lambda: incoming.extend(mine.get(timeout=120)))], incoming

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The ring's output and ``(dq, dk, dv)`` over the whole ``(B, h, T, d)`` sequence, each rank
        computing on its chunks."""
        out, grads = torch.empty_like(q), [torch.empty_like(t) for t in (q, k, v)]
        errors: list[BaseException] = []
        ranks = tuple(range(self.size))

        def rank_main(rank: int) -> None:
            try:
                self.local.rank = rank
                index = cp.context_parallel_indices(q.size(2), self.size, rank, q.device)
                ctx = _Ctx()
                local = [t[:, :, index].contiguous() for t in (q, k, v)]
                out[:, :, index] = cp._RingAttention.forward(ctx, *local, None, ranks, None)
                for grad, g in zip(grads, cp._RingAttention.backward(ctx, dout[:, :, index].contiguous())):
                    grad[:, :, index] = g
            except BaseException as e:  # reported by the main thread
                errors.append(e)
                for box in self.mailboxes:  # unblock the others
                    box.put([torch.full_like(q, float("nan"))] * 2)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        if errors:
            raise errors[0]
        torch.cuda.synchronize()
        return out, *grads


@pytest.mark.parametrize("size,dtype", [(2, torch.float32), (4, torch.float32), (4, torch.bfloat16),
                                        (8, torch.bfloat16)])
def test_ring_attention_on_cuda_equals_full_causal_sdpa(monkeypatch, size, dtype):
    ring = _ThreadRing(size)
    monkeypatch.setattr(cp, "_ring_step", ring.ring_step)
    monkeypatch.setattr(cp.dist, "get_rank", ring.get_rank)
    g = torch.Generator(device="cuda").manual_seed(size)
    batch, heads, length, dim = 2, 4, 2048, 64
    q, k, v, dout = (torch.randn(batch, heads, length, dim, device="cuda", generator=g).to(dtype) for _ in range(4))
    out, dq, dk, dv = ring.run(q, k, v, dout)

    ref = [t.float().requires_grad_() for t in (q, k, v)]
    want = cp.gathered_causal_attention(*ref)
    want.backward(dout.float())
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    assert out.dtype == dq.dtype == dtype
    torch.testing.assert_close(out.float(), want.detach(), rtol=tol, atol=tol)
    for got, expected in zip((dq, dk, dv), ref):
        rel = float((got.float() - expected.grad).norm() / expected.grad.norm())
        assert rel < tol, rel

    e = torch.empty((), dtype=dtype).element_size()
    n = batch * heads * (length // size) * dim
    forward = (size - 1) * 2 * n * e  # keys and values, C - 1 steps
    backward = (size - 1) * 2 * n * e + size * 2 * n * 4  # again, plus their fp32 gradients over C steps
    assert ring.sent_bytes == [forward + backward] * size
