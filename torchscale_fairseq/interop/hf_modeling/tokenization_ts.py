"""A transformers tokenizer with fairseq's ids for a SentencePiece model whose pieces are not all
in the fairseq dictionary (exported by ``ts-export-hf``; self-contained, loaded with
``trust_remote_code=True``).

``fairseq-preprocess`` leaves pieces the training data never used out of ``dict.txt``, and
fairseq's ``Dictionary.encode_line`` maps each such piece to ``<unk>``. A ``tokenizer.json`` cannot
give two pieces one id, so the backend keeps those pieces at ids from ``dictionary_size`` on (its
segmentation stays SentencePiece's), and this class maps every such id to ``<unk>``, one for one,
as fairseq does.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerFast


class TsTokenizerFast(PreTrainedTokenizerFast):
    """``PreTrainedTokenizerFast`` whose ids ``>= dictionary_size`` (an init keyword, saved in
    ``tokenizer_config.json``) become ``unk_token_id``. No ``__init__`` of its own: transformers loads
    ``tokenizer.json`` whole only for classes without one."""

    def _convert_encoding(self, encoding: Any, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], list[Any]]:
        encoding_dict, encodings = super()._convert_encoding(encoding, *args, **kwargs)
        size, unk = self.init_kwargs["dictionary_size"], self.unk_token_id
        encoding_dict["input_ids"] = [[unk if i >= size else i for i in ids] for ids in encoding_dict["input_ids"]]
        return encoding_dict, encodings
