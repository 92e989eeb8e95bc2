"""``--task streaming_mlm``: span-masked LM for ``ts_mlm`` on raw-text shards, SentencePiece on the fly.

Same shard index, mixing, sharding and exact resume as ``streaming_lm``
(:mod:`torchscale_fairseq.tasks.streaming`). Blocks are ``<s>`` + ``--tokens-per-sample``
- 1 packed stream tokens, span-masked (``--mask-prob``, ``--span-length``: see
:mod:`torchscale_fairseq.data.span_masking`), as TorchScale's pretraining task. The
dictionary is derived from the SentencePiece model (``--spm-model``, default
``DATA/spm.model``; ``python -m data_prep.train_spm DATA`` trains one), so a checkpoint
needs only the model file.
"""

from dataclasses import dataclass, field
from pathlib import Path

from fairseq.dataclass import FairseqDataclass
from fairseq.tasks import FairseqTask, register_task
from omegaconf import II

from torchscale_fairseq.data.document_encoders import (
    MASK_SYMBOL,
    SentencePieceDocuments,
    load_sentencepiece,
    sentencepiece_dictionary,
)
from torchscale_fairseq.data.lm_stream import held_out_documents
from torchscale_fairseq.data.mlm_stream import MaskedBlockDataset, MaskedBlockStream, SpanMasker
from torchscale_fairseq.data.stream_index import Corpus
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.tasks.streaming import StreamingTask, batches_per_epoch_field, document_masking_field


@dataclass
class StreamingMLMConfig(FairseqDataclass):
    data: str = field(default="", metadata={"help": "directory holding json/{train,valid}.json and the shards"})
    tokens_per_sample: int = field(default=512, metadata={"help": "tokens per block, <s> included"})
    spm_model: str = field(default="", metadata={"help": "SentencePiece model (default: DATA/spm.model)"})
    mask_prob: float = field(default=0.15, metadata={"help": "fraction of each block's tokens to mask"})
    span_length: float = field(default=3.0, metadata={"help": "mean length of a masked span"})
    batches_per_epoch: int = batches_per_epoch_field()
    document_masking: bool = document_masking_field()
    seed: int = II("common.seed")


def spm_model_path(cfg: StreamingMLMConfig) -> str:
    """``--spm-model``, or ``DATA/spm.model``."""
    return cfg.spm_model or str(Path(cfg.data or ".") / "spm.model")


@register_task("streaming_mlm", dataclass=StreamingMLMConfig)
class StreamingMLMTask(StreamingTask, FairseqTask):
    """Masked language modelling on raw text streamed from a JSON shard index."""

    name = "streaming_mlm"

    def __init__(self, cfg: StreamingMLMConfig, dictionary) -> None:
        super().__init__(cfg)
        self.dictionary = dictionary
        self.mask_idx = dictionary.index(MASK_SYMBOL)

    @classmethod
    def setup_task(cls, cfg: StreamingMLMConfig, **kwargs) -> "StreamingMLMTask":
        if not 0.0 < cfg.mask_prob < 1.0:
            raise TsConfigError(f"--mask-prob must be in (0, 1), got {cfg.mask_prob}")
        if cfg.span_length < 1.0:
            raise TsConfigError(f"--span-length must be at least 1, got {cfg.span_length}")
        return cls(cfg, sentencepiece_dictionary(load_sentencepiece(spm_model_path(cfg))))

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary

    def document_encoder(self) -> SentencePieceDocuments:
        """Raw-text documents -> fairseq ids (SentencePiece pieces)."""
        return SentencePieceDocuments(spm_model_path(self.cfg), self.dictionary)

    def masker(self) -> SpanMasker:
        d = self.dictionary
        return SpanMasker(d.bos(), d.pad(), self.mask_idx, self.cfg.mask_prob, self.cfg.span_length, self.cfg.seed)

    def check_tokenizer(self) -> None:
        load_sentencepiece(spm_model_path(self.cfg))

    def training_stream(self, corpora: list[Corpus], batch_size: int, dp_rank: int, dp_size: int,
                        n_local: int) -> MaskedBlockStream:
        return MaskedBlockStream(
            corpora, self.cfg.tokens_per_sample, batch_size, self.document_encoder(), self.dictionary.eos(),
            self.cfg.seed, dp_rank, dp_size, n_local, self.document_masking, masker=self.masker(),
        )  # fmt: skip

    def held_out_dataset(self, corpora: list[Corpus]) -> MaskedBlockDataset:
        """Every document of ``corpora`` once, in index order, packed and masked."""
        return MaskedBlockDataset(held_out_documents(corpora, self.document_encoder()), self.cfg.tokens_per_sample,
                                  self.masker(), self.document_masking)

    def max_positions(self) -> int:
        return self.cfg.tokens_per_sample
