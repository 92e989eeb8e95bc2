"""How a full tensor is cut into tensor-parallel shards and put back together.

A sharded parameter carries ``tensor_parallel_dim`` and ``tensor_parallel_stride``
(:mod:`.attributes`): the full tensor stacks ``stride`` independent blocks along that
dimension (e.g. 3 for a fused Q/K/V weight); each block is cut into N equal chunks and
rank r keeps chunk r of every block, so heads stay whole. Parameters without the
attributes are replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import torch

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.attributes import TP_STRIDE, TP_VOCAB, sharded_dim

VOCAB_SHARD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Vocabulary padded so each of ``tp_size`` slices is a multiple of 128 (N = 1: unpadded)."""
    if tp_size == 1:
        return vocab_size
    multiple = VOCAB_SHARD_MULTIPLE * tp_size
    return -(-vocab_size // multiple) * multiple


def shard_tensor(full: torch.Tensor, dim: int, stride: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (see the module docstring)."""
    if world_size == 1:
        return full
    blocks = full.chunk(stride, dim=dim)
    size = full.size(dim)
    if size % (stride * world_size) != 0:
        raise TsConfigError(
            f"a dimension of size {size} cannot be split into {stride} blocks x {world_size} "
            "tensor-parallel ranks: choose sizes divisible by --model-parallel-size"
        )
    return torch.cat([b.chunk(world_size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unshard_tensors(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` over all ranks' shards, in rank order."""
    if len(shards) == 1:
        return shards[0]
    per_rank_blocks = [s.chunk(stride, dim=dim) for s in shards]
    blocks = [torch.cat([blocks[i] for blocks in per_rank_blocks], dim=dim) for i in range(stride)]
    return torch.cat(blocks, dim=dim)


def layout(model: torch.nn.Module) -> dict[str, dict[str, int | None]]:
    """``{state_dict name: {"dim", "stride", "vocab"}}`` of every sharded parameter
    (shared parameters under each of their names), recorded in checkpoints."""
    return {
        name: {"dim": sharded_dim(p), "stride": getattr(p, TP_STRIDE, 1), "vocab": getattr(p, TP_VOCAB, None)}
        for name, p in model.named_parameters(remove_duplicate=False)
        if sharded_dim(p) is not None
    }


def reshard(shards: list[torch.Tensor], entry: dict[str, int | None], new_size: int) -> list[torch.Tensor]:
    """The ``new_size`` shards of the tensor split into ``shards``: unshard, trim or pad
    a vocabulary dimension to the new padded size, shard again."""
    dim, stride, vocab = entry["dim"], entry["stride"] or 1, entry["vocab"]
    full = unshard_tensors(shards, dim, stride)
    if vocab is not None:
        full = full.narrow(dim, 0, vocab)
        extra = padded_vocab_size(vocab, new_size) - vocab
        if extra > 0:
            pad_shape = list(full.shape)
            pad_shape[dim] = extra
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    return [shard_tensor(full, dim, stride, r, new_size).clone() for r in range(new_size)]
