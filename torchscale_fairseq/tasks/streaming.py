"""What the streaming tasks share: the JSON shard index, an endless resumable training
stream, and held-out splits read once through fairseq's usual batch iterator.

``DATA`` holds ``json/train.json`` and ``json/valid.json`` (see
:mod:`torchscale_fairseq.data.stream_index`); an epoch is ``--batches-per-epoch`` batches
of ``--batch-size`` blocks. A task supplies its tokenizer check, its training stream and
its held-out dataset. The task keeps the run's parallel context, read once when it is built.
"""

from dataclasses import field

from fairseq.data import FairseqDataset

from torchscale_fairseq.data.lm_stream import LMBlockStream, check_documents_per_reader
from torchscale_fairseq.data.stream_index import Corpus, load_index
from torchscale_fairseq.data.stream_iterator import StreamEpochBatchIterator
from torchscale_fairseq.errors import TsConfigError
from torchscale_fairseq.model_parallel.parallel_context import current_parallel_context


def batches_per_epoch_field():
    """The ``--batches-per-epoch`` option of the streaming tasks."""
    return field(default=1000, metadata={
        "help": "training batches per epoch (the stream itself never restarts; change it only at an epoch end)"})


def document_masking_field():
    """The ``--document-masking`` option of the streaming tasks."""
    return field(default=False, metadata={
        "help": "batches carry each token's document (net_input document_ids) and ts_lm / ts_mlm attend only within "
                "a document of a packed block; with --reset-positions-at-documents positions restart per document"})


class StreamSource(FairseqDataset):
    """The training split: the corpora to stream (batches come from :meth:`StreamingTask.get_batch_iterator`)."""

    def __init__(self, corpora: list[Corpus]) -> None:
        self.corpora = corpora

    def __len__(self) -> int:
        return 0


class StreamingTask:
    """Mixin for a fairseq task over raw-text shards (put it before the fairseq task class)."""

    name = "streaming"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.parallel = current_parallel_context()

    @property
    def options(self):
        """The task's options (``args`` of a legacy fairseq task, ``cfg`` of a dataclass one)."""
        args = getattr(self, "args", None)
        return args if args is not None else self.cfg

    @property
    def document_masking(self) -> bool:
        """Whether blocks carry ``document_ids`` (``--document-masking``); read by the ts models' builders."""
        return bool(getattr(self.options, "document_masking", False))

    def build_model(self, cfg, *args, **kwargs):
        """The model; under ``--document-masking`` only one that reads ``document_ids``."""
        model = super().build_model(cfg, *args, **kwargs)
        if self.document_masking and not getattr(model, "reads_document_ids", False):
            raise TsConfigError(
                f"--document-masking needs a model that reads document ids (ts_lm, ts_mlm), not {type(model).__name__}: "
                "change --arch or drop the flag"
            )
        return model

    def check_tokenizer(self) -> None:
        """Raise a one-line error if the tokenizer asset is missing or broken."""
        raise NotImplementedError

    def training_stream(self, corpora: list[Corpus], batch_size: int, dp_rank: int, dp_size: int,
                        n_local: int) -> LMBlockStream:
        raise NotImplementedError

    def held_out_dataset(self, corpora: list[Corpus]) -> FairseqDataset:
        raise NotImplementedError

    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs) -> None:
        """Check the index and shards of ``split`` (and the tokenizer) before training starts."""
        opts = self.options
        if not opts.data:
            raise TsConfigError(f"--task {self.name} needs DATA, the directory holding json/{{train,valid}}.json")
        if opts.tokens_per_sample < 2:
            raise TsConfigError(f"--tokens-per-sample must be at least 2, got {opts.tokens_per_sample}")
        self.check_tokenizer()
        corpora = load_index(opts.data, split)
        if split == getattr(opts, "train_subset", "train"):
            self.datasets[split] = StreamSource(corpora)
        else:
            self.datasets[split] = self.held_out_dataset(corpora)

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, num_workers=0, epoch=1, **kwargs):
        """The resumable stream iterator for training, fairseq's own for held-out splits."""
        parallel = self.parallel
        dp_rank, dp_size = parallel.data_rank, parallel.data_size
        if not isinstance(dataset, StreamSource):
            # every held-out block once: fairseq would drop a remainder that is not a multiple of 8
            kwargs.update(num_shards=dp_size, shard_id=dp_rank, required_batch_size_multiple=1)
            return super().get_batch_iterator(
                dataset, max_tokens=max_tokens, max_sentences=max_sentences, num_workers=num_workers, epoch=epoch,
                **kwargs,
            )  # fmt: skip
        if dataset in self.dataset_to_epoch_iter:
            return self.dataset_to_epoch_iter[dataset]
        opts = self.options
        batch_size = max_sentences or (max_tokens or 0) // opts.tokens_per_sample
        if batch_size < 1:
            raise TsConfigError(
                f"--task {self.name} needs --batch-size, or --max-tokens of at least --tokens-per-sample"
            )
        if opts.batches_per_epoch < 1:
            raise TsConfigError(f"--batches-per-epoch must be positive, got {opts.batches_per_epoch}")
        check_documents_per_reader(dataset.corpora, dp_size * max(1, num_workers))
        stream = self.training_stream(dataset.corpora, batch_size, dp_rank, dp_size, max(1, num_workers))
        itr = StreamEpochBatchIterator(stream, num_workers, opts.batches_per_epoch, epoch, parallel.data_group)
        self.dataset_to_epoch_iter[dataset] = itr
        return itr
