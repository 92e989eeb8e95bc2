"""Translate a binarized data split with an exported ``ts_transformer`` (``AutoModelForSeq2SeqLM``) as
``fairseq-generate`` translates it, and write ``fairseq-generate``'s output format (``H-`` lines), which
``data_prep.score_nmt`` scores: so the BLEU of the exported model and of the fairseq checkpoint are
computed the same way (``scripts/nmt/evaluate.sh`` runs fairseq's side).

Same batches (sources left-padded, sorted by length, at most ``--max-tokens`` tokens a batch), same
search (the folder's generation config: from ``</s>``, ``<pad>`` never, ``</s>`` not first; ``--beam``,
``--lenpen``, done once ``--beam`` hypotheses ended) and the same maximum length: ``</s>`` is forced at
step ``min(int(--max-len-a * S + --max-len-b), max_target_positions - 1)``, ``S`` the batch's source width.

Run from the repository root::

    python -m torchscale_fairseq.interop.hf_translate --folder hf_nmt --data data-bin/kjv_sparv_spm \\
        --subset test --beam 5 --lenpen 1.0 --max-len-a 1.2 --max-len-b 256 > generate_hf_test.txt

With ``--text`` (repeatable) it translates raw text instead, through the folder's own tokenizer (the
SentencePiece one ``ts-export-hf`` writes for ``prepare_nmt`` data), one translation per line.
``--no-repeat-ngram-size N`` blocks repeated n-grams as fairseq-generate's option of that name does.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def forcing(prefix: torch.Tensor, total: int, beams: int, eos: int) -> Any:
    """A ``transformers`` ``LogitsProcessor`` keeping only the token of ``prefix`` (one row per input,
    ``beams`` rows of scores each) at its step, then ``</s>`` at step ``total``, each at its
    log-probability: the steps fairseq's ``SequenceGenerator`` forces (a prefix, the maximum length)."""
    from transformers import LogitsProcessor

    class Forced(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            step = input_ids.size(1) - 1
            if step < prefix.size(1):
                token = prefix[:, step].repeat_interleave(beams).unsqueeze(1)
            elif step == total:
                token = torch.full((scores.size(0), 1), eos, device=scores.device)
            else:
                return scores
            return torch.full_like(scores, -math.inf).scatter(1, token, scores.gather(1, token))

    return Forced()


def hypotheses(sequences: torch.Tensor, eos: int) -> list[list[int]]:
    """Per row of ``generate()``'s output, its tokens after the first (``</s>``) up to and with its ``</s>``."""
    rows = []
    for row in sequences[:, 1:].tolist():
        rows.append(row[:row.index(eos) + 1] if eos in row else row)
    return rows


def batches(data: str, subset: str, source_lang: str, target_lang: str,
            max_tokens: int) -> Iterator[tuple[list[int], torch.Tensor]]:
    """fairseq-generate's batches of the split: sentence ids and left-padded source ids."""
    from fairseq.data import Dictionary, LanguagePairDataset, data_utils

    pair = f"{data}/{subset}.{source_lang}-{target_lang}"
    src_dict = Dictionary.load(f"{data}/dict.{source_lang}.txt")
    tgt_dict = Dictionary.load(f"{data}/dict.{target_lang}.txt")
    src = data_utils.load_indexed_dataset(f"{pair}.{source_lang}", src_dict)
    tgt = data_utils.load_indexed_dataset(f"{pair}.{target_lang}", tgt_dict)
    if src is None:
        raise SystemExit(f"error: no binarized split {pair}.{source_lang} in {data}")
    dataset = LanguagePairDataset(src, src.sizes, src_dict, tgt, tgt.sizes if tgt is not None else None, tgt_dict,
                                  left_pad_source=True)
    for batch in dataset.batch_by_size(dataset.ordered_indices(), max_tokens=max_tokens):
        sample = dataset.collater([dataset[i] for i in batch])
        yield sample["id"].tolist(), sample["net_input"]["src_tokens"]


def translate(model: Any, source: torch.Tensor, beam: int, lenpen: float, max_len_a: float,
              max_len_b: int, no_repeat_ngram_size: int = 0) -> tuple[list[list[int]], list[float]]:
    """The best hypothesis (tokens up to and with ``</s>``) and its score per row of ``source`` (beam search's:
    the sum of its log-probabilities over its length ** ``lenpen``; NaN for greedy search, ``beam`` 1);
    ``no_repeat_ngram_size`` > 0 bans every token that would repeat an n-gram of the hypothesis."""
    from transformers import LogitsProcessorList

    eos = model.generation_config.eos_token_id
    total = min(int(max_len_a * source.size(1) + max_len_b), model.config.max_position_embeddings - 1)
    with torch.no_grad():
        out = model.generate(source, num_beams=beam, length_penalty=lenpen, max_new_tokens=total + 1,
                             logits_processor=LogitsProcessorList([forcing(source[:, :0], total, beam, eos)]),
                             no_repeat_ngram_size=no_repeat_ngram_size or None,
                             return_dict_in_generate=True, output_scores=beam > 1)
    tokens = hypotheses(out.sequences, eos)
    return tokens, out.sequences_scores.tolist() if beam > 1 else [math.nan] * len(tokens)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", required=True, help="the ts-export-hf folder of a ts_transformer")
    parser.add_argument("--data", help="the binarized data directory (dict.*.txt, SUBSET.SRC-TGT.*)")
    parser.add_argument("--text", action="append", help="raw text to translate with the folder's tokenizer "
                        "(repeatable) instead of a binarized split")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--source-lang", default="en")
    parser.add_argument("--target-lang", default="es")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--lenpen", type=float, default=1.0)
    parser.add_argument("--max-len-a", type=float, default=0.0)
    parser.add_argument("--max-len-b", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--no-repeat-ngram-size", type=int, default=0)
    args = parser.parse_args(argv)
    if (args.data is None) == (args.text is None):
        parser.error("give --data (a binarized split) or --text (raw text), not both and not neither")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Print ``H-<id>\\t<score>\\t<target pieces>`` per sentence, as fairseq-generate does
    (the score in base 2, as it prints it); with ``--text``, each text's translation."""
    from fairseq.data import Dictionary
    from transformers import AutoModelForSeq2SeqLM

    args = parse_args(argv)
    search = (args.beam, args.lenpen, args.max_len_a, args.max_len_b, args.no_repeat_ngram_size)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.folder, trust_remote_code=True).eval()
    if args.text is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.folder, trust_remote_code=True)
        for text in args.text:
            [hyp], _ = translate(model, tokenizer(text, return_tensors="pt").input_ids, *search)
            sys.stdout.write(tokenizer.decode(hyp, skip_special_tokens=True) + "\n")
        return
    tgt_dict = Dictionary.load(f"{args.data}/dict.{args.target_lang}.txt")
    for ids, source in batches(args.data, args.subset, args.source_lang, args.target_lang, args.max_tokens):
        tokens, scores = translate(model, source, *search)
        for sent_id, hyp, score in zip(ids, tokens, scores):
            sys.stdout.write(f"H-{sent_id}\t{score / math.log(2):.6f}\t{tgt_dict.string(torch.tensor(hyp))}\n")


if __name__ == "__main__":
    main()
