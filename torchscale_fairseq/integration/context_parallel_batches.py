"""A fairseq language-model sample as one rank of a context-parallel group sees it.

The ``C`` ranks of a context-parallel group read the same batch (sharded over the data-parallel
ranks only); the decoder embeds this rank's chunks ``r`` and ``2C-1-r`` of the whole token ids
itself (:class:`~torchscale_fairseq.architecture.decoder.TransformerDecoder`), so the sample keeps
its ``net_input`` and gets the same chunks of its targets (padded as the decoder pads the tokens).
``ntokens`` counts this rank's real targets and ``nsentences`` is counted on context rank 0 only,
so that their sums over the data-parallel x context-parallel group, over which fairseq reduces the
sample size, the logged statistics and (averaging) the gradients, are those of ``C = 1``: the
loss is a sum over tokens, each held by exactly one rank of the group. A split sample carries
``SPLIT_KEY`` (fairseq's dummy batch may be a raw first batch or an already prepared sample).
"""

from __future__ import annotations

from typing import Any

from torchscale_fairseq.model_parallel.context_parallel import context_parallel_indices, pad_to_multiple

SPLIT_KEY = "context_parallel_part"


def context_parallel_sample(sample: dict[str, Any], size: int, rank: int, multiple: int, pad: int) -> dict[str, Any]:
    """This rank's view of ``sample`` (module docstring), a new dict (``sample`` itself if already
    split); ``multiple``: what the decoder pads the sequence to
    (:func:`~torchscale_fairseq.model_parallel.context_parallel.sequence_multiple`)."""
    if sample.get(SPLIT_KEY):
        return sample
    target = pad_to_multiple(sample["target"], multiple, pad)
    local = target[:, context_parallel_indices(target.size(1), size, rank, target.device)]
    part = dict(sample)
    part["target"] = local
    part["ntokens"] = int(local.ne(pad).sum())  # on the host's copy: the trainer moves the sample afterwards
    part["nsentences"] = sample["nsentences"] if rank == 0 else 0
    part[SPLIT_KEY] = True
    return part
