"""fairseq's ``cross_entropy``, ``label_smoothed_cross_entropy`` and ``masked_lm``
criterions computed vocabulary-parallel under tensor parallelism.

:func:`install` replaces the three registry entries by subclasses that keep the flags,
the dataclasses and the class names (so checkpoints' ``criterion_name`` still matches).
At tensor-parallel size 1 they are the stock criterions; at size N > 1 they feed the
model's vocabulary-sharded logits to
:func:`~torchscale_fairseq.model_parallel.cross_entropy.vocab_parallel_cross_entropy`,
so no rank ever holds ``b x s x V`` logits and only per-token scalars are exchanged.
The losses equal the size-1 ones (label smoothing ``eps / (V - 1)`` over the real
vocabulary, padded entries excluded). Each criterion keeps the run's parallel context, read once
when fairseq builds it (:class:`ParallelCriterion`).
"""

from __future__ import annotations

import torch
from fairseq import criterions
from fairseq.criterions import cross_entropy, label_smoothed_cross_entropy, masked_lm

from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.cross_entropy import (
    label_smoothed_loss,
    vocab_parallel_cross_entropy,
)
from torchscale_fairseq.model_parallel.layers import padded_vocab_size
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext, current_parallel_context


class ParallelCriterion:
    """A criterion that keeps the run's parallel context (put it before the fairseq criterion class)."""

    parallel: ParallelContext = ParallelContext.single_process()  # criteria built without build_criterion

    @classmethod
    def build_criterion(cls, cfg, task):
        criterion = super().build_criterion(cfg, task)
        criterion.parallel = current_parallel_context()
        return criterion

    @property
    def tensor_parallel(self) -> bool:
        return self.parallel.tensor_size > 1

    @property
    def tensor_group(self):
        """The tensor-parallel group the logits' vocabulary is split over."""
        return self.parallel.tensor_group


def _sum_or_keep(x: torch.Tensor, reduce: bool) -> torch.Tensor:
    return x.sum() if reduce else x


class CrossEntropyCriterion(ParallelCriterion, cross_entropy.CrossEntropyCriterion):
    __doc__ = cross_entropy.CrossEntropyCriterion.__doc__

    def forward(self, model, sample, reduce=True):
        """fairseq's, but a model built with ``--ts-fused-cross-entropy`` returns its features and
        its decoder's ``output_loss`` takes the loss without full logits."""
        decoder = getattr(model, "decoder", None)
        if not (reduce and getattr(decoder, "fuses_output_loss", False)):
            return super().forward(model, sample, reduce)
        net_output = model(**sample["net_input"], features_only=True)
        loss = decoder.output_loss(net_output[0], model.get_targets(sample, net_output), self.padding_idx)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output

    def compute_loss(self, model, net_output, sample, reduce=True):
        if not self.tensor_parallel:
            return super().compute_loss(model, net_output, sample, reduce)
        logits = net_output[0]
        target = model.get_targets(sample, net_output)
        nll = vocab_parallel_cross_entropy(logits, target, len(self.task.target_dictionary), self.tensor_group).nll
        nll = nll.masked_fill(target.eq(self.padding_idx), 0.0).view(-1)
        loss = _sum_or_keep(nll, reduce)
        return loss, loss


class LabelSmoothedCrossEntropyCriterion(ParallelCriterion, label_smoothed_cross_entropy.LabelSmoothedCrossEntropyCriterion):
    __doc__ = label_smoothed_cross_entropy.LabelSmoothedCrossEntropyCriterion.__doc__

    def _parallel_losses(self, model, net_output, sample):
        """The vocabulary-parallel losses of ``net_output``: computed by ``compute_loss`` and, with
        ``--report-accuracy``, kept for the ``compute_accuracy`` that follows it on the same output
        (one cross-entropy per micro-batch)."""
        kept = self.__dict__.pop("_losses_of_output", None)
        if kept is not None and kept[0] is net_output:
            return kept[1]
        result = self._compute_parallel_losses(model, net_output, sample)
        if self.report_accuracy:
            self._losses_of_output = (net_output, result)
        return result

    def _compute_parallel_losses(self, model, net_output, sample):
        logits, target = net_output[0], model.get_targets(sample, net_output)
        if self.ignore_prefix_size > 0:
            logits = logits[:, self.ignore_prefix_size :, :]
            target = target[:, self.ignore_prefix_size :]
        target = target.reshape(-1)
        vocab = len(self.task.target_dictionary)
        losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.size(-1)), target, vocab, self.tensor_group)
        return losses, target, vocab

    def compute_loss(self, model, net_output, sample, reduce=True):
        if not self.tensor_parallel:
            return super().compute_loss(model, net_output, sample, reduce)
        losses, target, vocab = self._parallel_losses(model, net_output, sample)
        if reduce:
            return label_smoothed_loss(losses, target, self.eps, vocab, self.padding_idx)
        pad = target.eq(self.padding_idx)
        nll, smooth = losses.nll.masked_fill(pad, 0.0), losses.smooth.masked_fill(pad, 0.0)
        eps_i = self.eps / (vocab - 1)
        return (1.0 - self.eps - eps_i) * nll + eps_i * smooth, nll

    def compute_accuracy(self, model, net_output, sample):
        if not self.tensor_parallel:
            return super().compute_accuracy(model, net_output, sample)
        losses, target, _ = self._parallel_losses(model, net_output, sample)
        mask = target.ne(self.padding_idx)
        return torch.sum(losses.target_is_max.masked_select(mask)), torch.sum(mask)


class MaskedLmLoss(ParallelCriterion, masked_lm.MaskedLmLoss):
    __doc__ = masked_lm.MaskedLmLoss.__doc__

    def forward(self, model, sample, reduce=True):
        if not self.tensor_parallel:
            return super().forward(model, sample, reduce)
        masked_tokens = sample["target"].ne(self.padding_idx)
        sample_size = masked_tokens.int().sum()
        if not bool(masked_tokens.any()):
            masked_tokens = None
        logits = model(**sample["net_input"], masked_tokens=masked_tokens, vocab_parallel_logits=True)[0]
        vocab = len(self.task.source_dictionary)
        n = self.parallel.tensor_size
        if logits.size(-1) != padded_vocab_size(vocab, n) // n:
            raise TsConfigError(
                "masked_lm at --model-parallel-size > 1 needs a model that returns vocabulary-parallel "
                "logits: use --arch ts_mlm*"
            )
        targets = model.get_targets(sample, [logits])
        if masked_tokens is not None:
            targets = targets[masked_tokens]
        targets = targets.reshape(-1)
        nll = vocab_parallel_cross_entropy(logits.reshape(-1, logits.size(-1)), targets, vocab, self.tensor_group).nll
        loss = nll.masked_fill(targets.eq(self.padding_idx), 0.0).sum()
        logging_output = {
            "loss": loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["nsentences"],
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output


REPLACEMENTS = {
    "cross_entropy": CrossEntropyCriterion,
    "label_smoothed_cross_entropy": LabelSmoothedCrossEntropyCriterion,
    "masked_lm": MaskedLmLoss,
}


def install() -> None:
    """Point fairseq's registry entries at the vocabulary-parallel subclasses (idempotent)."""
    for name, cls in REPLACEMENTS.items():
        criterions.CRITERION_REGISTRY[name] = cls
