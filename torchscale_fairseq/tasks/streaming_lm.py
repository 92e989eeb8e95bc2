"""``--task streaming_lm``: causal LM on raw-text shards, GPT-2 BPE on the fly (no ``fairseq-preprocess``).

``DATA`` holds ``json/train.json`` and ``json/valid.json`` (see
:mod:`torchscale_fairseq.data.stream_index`). Training reads an endless, weighted,
packed stream (:mod:`torchscale_fairseq.data.lm_stream`); an epoch is
``--batches-per-epoch`` batches of ``--batch-size`` blocks. Validation tokenizes its
held-out shards once and uses fairseq's usual block dataset. The dictionary is the
``data_prep`` GPT-2 one (fairseq id = GPT-2 id + 4), so checkpoints are interchangeable
with ``--task language_modeling`` on ``data_prep.prepare_lm`` data.
"""

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from fairseq.data import Dictionary, FairseqDataset, ListDataset, MonolingualDataset, TokenBlockDataset
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from torchscale_fairseq.data import gpt2_bpe
from torchscale_fairseq.data.lm_stream import LMBlockStream, document_ids
from torchscale_fairseq.data.stream_index import Corpus, load_index
from torchscale_fairseq.data.stream_iterator import StreamEpochBatchIterator
from torchscale_fairseq.data.text_shards import ShardReader
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel import process_groups

logger = logging.getLogger(__name__)


@dataclass
class StreamingLMConfig(LanguageModelingConfig):
    batches_per_epoch: int = field(
        default=1000, metadata={"help": "training batches per epoch (the stream itself never restarts)"}
    )


def gpt2_dictionary() -> Dictionary:
    """The ``data_prep`` LM dictionary: symbols ``"0".."50256"`` after fairseq's 4 specials."""
    dictionary = Dictionary()
    for i in range(gpt2_bpe.N_VOCAB):
        dictionary.add_symbol(str(i), n=1)
    return dictionary


class StreamSource(FairseqDataset):
    """The training split: the corpora to stream (batches come from :meth:`StreamingLMTask.get_batch_iterator`)."""

    def __init__(self, corpora: list[Corpus]) -> None:
        self.corpora = corpora

    def __len__(self) -> int:
        return 0


@register_task("streaming_lm", dataclass=StreamingLMConfig)
class StreamingLMTask(LanguageModelingTask):
    """Language modelling on raw text streamed from a JSON shard index."""

    @classmethod
    def setup_dictionary(cls, args, **kwargs):
        dictionary = gpt2_dictionary()
        return dictionary, dictionary

    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs) -> None:
        """Check the index and shards of ``split`` (and the tokenizer) before training starts."""
        if not self.args.data:
            raise TsConfigError("--task streaming_lm needs DATA, the directory holding json/{train,valid}.json")
        if self.args.tokens_per_sample < 1:
            raise TsConfigError(f"--tokens-per-sample must be positive, got {self.args.tokens_per_sample}")
        gpt2_bpe.get_gpt2_encoding()
        corpora = load_index(self.args.data, split)
        if split == getattr(self.args, "train_subset", "train"):
            self.datasets[split] = StreamSource(corpora)
        else:
            self.datasets[split] = self._held_out_dataset(corpora)

    def _held_out_dataset(self, corpora: list[Corpus]) -> MonolingualDataset:
        """Every document of ``corpora`` once, in index order, as fairseq LM blocks."""
        eos, offset = self.dictionary.eos(), self.dictionary.nspecial
        docs = []
        for corpus in corpora:
            for shard in corpus.shards:
                reader = ShardReader(shard)
                docs.extend(torch.tensor(document_ids(doc.lines, eos, offset)) for doc in reader)
                if reader.bad_bytes:
                    logger.warning("skipped %d undecodable byte(s) in %s", reader.bad_bytes, shard)
        sizes = np.array([len(d) for d in docs])
        blocks = TokenBlockDataset(
            ListDataset(docs, sizes), sizes, self.args.tokens_per_sample, pad=self.dictionary.pad(), eos=eos,
            break_mode="none", include_targets=True,
        )  # fmt: skip
        return MonolingualDataset(
            blocks, blocks.sizes, self.dictionary, self.output_dictionary, add_eos_for_other_targets=False,
            shuffle=False, targets=self.targets, add_bos_token=False,
        )  # fmt: skip

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, num_workers=0, epoch=1, **kwargs):
        """The resumable stream iterator for training, fairseq's own for held-out splits."""
        dp_rank, dp_size = process_groups.get_data_parallel_rank(), process_groups.get_data_parallel_world_size()
        if not isinstance(dataset, StreamSource):
            # every held-out block once: fairseq would drop a remainder that is not a multiple of 8
            kwargs.update(num_shards=dp_size, shard_id=dp_rank, required_batch_size_multiple=1)
            return super().get_batch_iterator(
                dataset, max_tokens=max_tokens, max_sentences=max_sentences, num_workers=num_workers, epoch=epoch,
                **kwargs,
            )  # fmt: skip
        if dataset in self.dataset_to_epoch_iter:
            return self.dataset_to_epoch_iter[dataset]
        batch_size = max_sentences or (max_tokens or 0) // self.args.tokens_per_sample
        if batch_size < 1:
            raise TsConfigError(
                "--task streaming_lm needs --batch-size, or --max-tokens of at least --tokens-per-sample"
            )
        if self.args.batches_per_epoch < 1:
            raise TsConfigError(f"--batches-per-epoch must be positive, got {self.args.batches_per_epoch}")
        stream = LMBlockStream(
            dataset.corpora, self.args.tokens_per_sample, batch_size, self.dictionary.eos(), self.dictionary.nspecial,
            self.args.seed, dp_rank, dp_size, max(1, num_workers),
        )  # fmt: skip
        itr = StreamEpochBatchIterator(stream, num_workers, self.args.batches_per_epoch, epoch)
        self.dataset_to_epoch_iter[dataset] = itr
        return itr
