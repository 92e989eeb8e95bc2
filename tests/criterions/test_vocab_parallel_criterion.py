"""The vocabulary-parallel criteria against fairseq's own, in one process (tensor-parallel size 1
is the degenerate case of the same code: the collectives over no group)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.model_utils import dictionary
from torchscale_fairseq.criterions import vocab_parallel
from torchscale_fairseq.model_parallel.parallel_context import ParallelContext


class TinyDecoder(nn.Module):
    """Logits from a fixed table: just what the criteria call on a model."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.randn(2, 7, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, src_tokens, src_lengths):
        return self.logits, {}

    def get_targets(self, sample, net_output):
        return sample["target"]

    def get_normalized_probs(self, net_output, log_probs, sample=None):
        return F.log_softmax(net_output[0].float(), dim=-1) if log_probs else F.softmax(net_output[0].float(), dim=-1)


class Task:
    def __init__(self, d) -> None:
        self.target_dictionary = d


def test_accuracy_reuses_the_cross_entropy_of_the_loss(monkeypatch):
    """``label_smoothed_cross_entropy --report-accuracy`` under tensor parallelism computes the
    vocabulary-parallel cross-entropy once per micro-batch (``compute_accuracy`` takes the one
    ``compute_loss`` computed), and gives fairseq's loss, nll and accuracy."""
    d = dictionary()
    target = torch.randint(d.nspecial, len(d), (2, 7), generator=torch.Generator().manual_seed(1))
    target[1, 5:] = d.pad()
    sample = {"net_input": {"src_tokens": target, "src_lengths": torch.tensor([7, 5])}, "target": target,
              "ntokens": int(target.ne(d.pad()).sum()), "nsentences": 2}
    model = TinyDecoder(len(d))
    with torch.no_grad():  # four right answers
        model.logits[0, :4].scatter_(1, target[0, :4, None], 10.0)
    criterion = vocab_parallel.LabelSmoothedCrossEntropyCriterion(Task(d), False, 0.1, report_accuracy=True)
    _, _, stock = criterion(model, sample)
    calls = []
    parallel_ce = vocab_parallel.vocab_parallel_cross_entropy
    monkeypatch.setattr(vocab_parallel, "vocab_parallel_cross_entropy",
                        lambda *args: calls.append(1) or parallel_ce(*args))
    criterion.parallel = ParallelContext(2, 0, (0, 1), (0,), (0,), (0,))  # two tensor-parallel ranks, no group
    for _ in range(2):  # a second micro-batch: no stale reuse
        _, _, got = criterion(model, sample)
    assert len(calls) == 2, "one vocabulary-parallel cross-entropy per micro-batch"
    for key in ("loss", "nll_loss"):
        torch.testing.assert_close(torch.as_tensor(got[key]), torch.as_tensor(stock[key]), rtol=1e-5, atol=1e-5)
    assert (int(got["n_correct"]), int(got["total"])) == (int(stock["n_correct"]), int(stock["total"]))
    assert int(got["total"]) == int(target.ne(d.pad()).sum()) and int(got["n_correct"]) >= 4
