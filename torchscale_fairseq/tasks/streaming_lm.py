"""``--task streaming_lm``: causal LM on raw-text shards, GPT-2 BPE on the fly (no ``fairseq-preprocess``).

Training reads an endless, weighted, packed stream
(:mod:`torchscale_fairseq.data.lm_stream`); validation tokenizes its held-out shards once
and uses fairseq's usual block dataset. The dictionary is the ``data_prep`` GPT-2 one
(fairseq id = GPT-2 id + 4), so checkpoints are interchangeable with
``--task language_modeling`` on ``data_prep.prepare_lm`` data.
"""

from dataclasses import dataclass

import numpy as np
import torch
from fairseq.data import Dictionary, ListDataset, MonolingualDataset, TokenBlockDataset
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from torchscale_fairseq.data import gpt2_bpe
from torchscale_fairseq.data.document_encoders import GPT2Documents
from torchscale_fairseq.data.lm_stream import DocumentIdsDataset, LMBlockStream, held_out_documents
from torchscale_fairseq.data.stream_index import Corpus
from torchscale_fairseq.tasks.streaming import StreamingTask, batches_per_epoch_field, document_masking_field


@dataclass
class StreamingLMConfig(LanguageModelingConfig):
    batches_per_epoch: int = batches_per_epoch_field()
    document_masking: bool = document_masking_field()


def gpt2_dictionary() -> Dictionary:
    """The ``data_prep`` LM dictionary: symbols ``"0".."50256"`` after fairseq's 4 specials."""
    dictionary = Dictionary()
    for i in range(gpt2_bpe.N_VOCAB):
        dictionary.add_symbol(str(i), n=1)
    return dictionary


@register_task("streaming_lm", dataclass=StreamingLMConfig)
class StreamingLMTask(StreamingTask, LanguageModelingTask):
    """Language modelling on raw text streamed from a JSON shard index."""

    name = "streaming_lm"

    @classmethod
    def setup_dictionary(cls, args, **kwargs):
        dictionary = gpt2_dictionary()
        return dictionary, dictionary

    def document_encoder(self) -> GPT2Documents:
        """Raw-text documents -> fairseq ids (GPT-2 BPE)."""
        return GPT2Documents(self.dictionary.eos(), self.dictionary.nspecial)

    def check_tokenizer(self) -> None:
        gpt2_bpe.get_gpt2_encoding()

    def training_stream(self, corpora: list[Corpus], batch_size: int, dp_rank: int, dp_size: int,
                        n_local: int) -> LMBlockStream:
        return LMBlockStream(
            corpora, self.args.tokens_per_sample, batch_size, self.document_encoder(), self.dictionary.eos(),
            self.args.seed, dp_rank, dp_size, n_local, self.document_masking,
        )  # fmt: skip

    def held_out_dataset(self, corpora: list[Corpus]) -> MonolingualDataset | DocumentIdsDataset:
        """Every document of ``corpora`` once, in index order, as fairseq LM blocks (with their
        ``document_ids`` under ``--document-masking``)."""
        eos = self.dictionary.eos()
        docs = [torch.tensor(d) for d in held_out_documents(corpora, self.document_encoder())]
        sizes = np.array([len(d) for d in docs])
        blocks = TokenBlockDataset(
            ListDataset(docs, sizes), sizes, self.args.tokens_per_sample, pad=self.dictionary.pad(), eos=eos,
            break_mode="none", include_targets=True,
        )  # fmt: skip
        dataset = MonolingualDataset(
            blocks, blocks.sizes, self.dictionary, self.output_dictionary, add_eos_for_other_targets=False,
            shuffle=False, targets=self.targets, add_bos_token=False,
        )  # fmt: skip
        if not self.document_masking:
            return dataset
        firsts = [torch.zeros(len(d), dtype=torch.long).index_fill_(0, torch.tensor([0]), 1) for d in docs]
        begins = TokenBlockDataset(ListDataset(firsts, sizes), sizes, self.args.tokens_per_sample, pad=0, eos=0,
                                   break_mode="none")
        return DocumentIdsDataset(dataset, begins)
