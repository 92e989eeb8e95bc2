"""Sample a continuation of a text prompt from a trained GPT-2-BPE fairseq language model.

The dataset's ``dict.txt`` (written by :mod:`data_prep.prepare_lm`) has the GPT-2 ids as
its symbols, so the prompt is GPT-2-encoded, mapped through the fairseq dictionary, and the
generated fairseq ids are mapped back to GPT-2 ids and decoded.

Run from the repository root::

    python -m data_prep.sample_lm --checkpoint-dir checkpoints/demo_lm \
        --data data-bin/enwiki_gpt2 --prompt "The history of"
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python data_prep/sample_lm.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from fairseq.data import Dictionary

from torchscale_fairseq.data import gpt2_bpe
from torchscale_fairseq.models.lm import TsLanguageModel

USER_DIR = Path(__file__).resolve().parent.parent / "torchscale_fairseq"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True, help="fairseq-train --save-dir")
    parser.add_argument("--checkpoint-file", default="checkpoint_best.pt", help="file in --checkpoint-dir")
    parser.add_argument("--data", required=True, help="binarized data directory (holds dict.txt)")
    parser.add_argument("--prompt", default="The history of", help="text to continue")
    parser.add_argument("--max-len", type=int, default=40, help="number of new GPT-2 tokens at most")
    parser.add_argument("--topk", type=int, default=10, help="sample from the k most likely tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--seed", type=int, default=1, help="random seed")
    parser.add_argument("--user-dir", default=str(USER_DIR), help="fairseq --user-dir of the plugin")
    return parser.parse_args(argv)


def gpt2_to_fairseq(ids: Sequence[int], dictionary: Dictionary) -> torch.LongTensor:
    """Fairseq ids of GPT-2 ``ids`` (looked up as symbols in ``dictionary``), no final ``</s>``."""
    line = " ".join(map(str, ids))
    return dictionary.encode_line(line, add_if_not_exist=False, append_eos=False).long()


def fairseq_to_gpt2(tokens: Sequence[int], dictionary: Dictionary) -> list[int]:
    """GPT-2 ids of fairseq ``tokens``, dropping fairseq's special symbols."""
    specials = {dictionary.bos(), dictionary.pad(), dictionary.eos(), dictionary.unk()}
    return [int(dictionary[t]) for t in map(int, tokens) if t not in specials]


def sample_ids(
    hub: Any, prompt_ids: Sequence[int], max_len: int = 40, topk: int = 10, temperature: float = 1.0, seed: int = 1
) -> list[int]:
    """GPT-2 ids of ``prompt_ids`` followed by at most ``max_len`` tokens sampled from a fairseq
    ``GeneratorHubInterface`` language model (top-k sampling, stops at ``</s>``)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty; give some text to continue")
    dictionary = hub.task.source_dictionary
    prompt_tokens = gpt2_to_fairseq(prompt_ids, dictionary)
    if dictionary.unk() in prompt_tokens.tolist():
        raise ValueError("the model's dict.txt does not list GPT-2 ids; use data made by data_prep.prepare_lm")
    limit = hub.models[0].max_decoder_positions()
    if len(prompt_ids) >= limit:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this model reads at most {limit - 1}")
    torch.manual_seed(seed)
    hypos = hub.generate(
        [prompt_tokens],
        beam=1,
        sampling=True,
        sampling_topk=topk,
        temperature=temperature,
        max_len_a=0,
        max_len_b=len(prompt_ids) + max_len,
    )
    return fairseq_to_gpt2(hypos[0][0]["tokens"].tolist(), dictionary)


def continue_prompt(
    hub: Any, prompt: str, max_len: int = 40, topk: int = 10, temperature: float = 1.0, seed: int = 1
) -> str:
    """The text sampled after ``prompt`` (see :func:`sample_ids`)."""
    prompt_ids = gpt2_bpe.encode(prompt, disallowed_special=())
    ids = sample_ids(hub, prompt_ids, max_len, topk, temperature, seed)
    return gpt2_bpe.decode(ids[len(prompt_ids) :])


def load_lm(
    checkpoint_dir: str, data: str, checkpoint_file: str = "checkpoint_best.pt", user_dir: str = str(USER_DIR)
) -> Any:
    """The hub interface (``GeneratorHubInterface``) of a trained ``TsLanguageModel``, on CPU, in eval mode."""
    checkpoint = Path(checkpoint_dir) / checkpoint_file
    if not checkpoint.is_file():
        raise SystemExit(f"error: checkpoint {checkpoint} not found; train first (see scripts/demo.sh)")
    if not (Path(data) / "dict.txt").is_file():
        raise SystemExit(f"error: {Path(data) / 'dict.txt'} not found; fix: python -m data_prep.prepare_lm")
    hub = TsLanguageModel.from_pretrained(
        str(Path(checkpoint_dir).resolve()),
        checkpoint_file,
        data_name_or_path=str(Path(data).resolve()),
        user_dir=str(Path(user_dir).resolve()),
    )
    return hub.eval()


def main(argv: Sequence[str] | None = None) -> str:
    """Entry point: print and return the sampled continuation."""
    args = parse_args(argv)
    hub = load_lm(args.checkpoint_dir, args.data, args.checkpoint_file, args.user_dir)
    try:
        continuation = continue_prompt(hub, args.prompt, args.max_len, args.topk, args.temperature, args.seed)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    print(f"{args.prompt}{continuation}")
    return continuation


if __name__ == "__main__":
    main()
