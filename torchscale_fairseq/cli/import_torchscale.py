"""``ts-import-torchscale SOURCE OUTPUT --data DATA [--source-lang S --target-lang T]``: a TorchScale
``Decoder`` checkpoint (Magneto ``subln`` or ``deepnorm``, dense or MoE) as a ``ts_lm`` checkpoint for
``fairseq-train --restore-file``, ``fairseq-eval-lm`` and ``ts-export-hf``, or an ``EncoderDecoder``
as a ``ts_transformer`` (see :mod:`torchscale_fairseq.interop.torchscale_import`)."""

from __future__ import annotations

import argparse
import os
import sys

from torchscale_fairseq.errors import install_excepthook


def main(argv: list[str] | None = None) -> None:
    install_excepthook()
    parser = argparse.ArgumentParser(prog="ts-import-torchscale", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="TorchScale checkpoint (model + DecoderConfig under cfg.model or args)")
    parser.add_argument("output", help="ts_lm checkpoint to write (must not exist)")
    parser.add_argument("--data", required=True, help="fairseq data directory whose dict.txt matches the embedding")
    parser.add_argument("--positions", default="none",
                        help="without a learned table: none (TorchScale Decoder default) or sinusoidal (fairseq's)")
    parser.add_argument("--source-lang", help="an EncoderDecoder's source language (DATA/dict.SRC.txt)")
    parser.add_argument("--target-lang", help="an EncoderDecoder's target language (DATA/dict.TGT.txt)")
    args = parser.parse_args(argv)
    import torchscale_fairseq  # noqa: F401  (registers the ts models)
    from torchscale_fairseq.interop.torchscale_import import import_torchscale

    langs = (args.source_lang, args.target_lang) if args.source_lang and args.target_lang else None
    flags = import_torchscale(args.source, args.output, args.data, args.positions, langs)
    user_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if langs:
        evaluate = f"fairseq-generate {args.data} -s {langs[0]} -t {langs[1]}"
        task = f"--task translation -s {langs[0]} -t {langs[1]} --arch ts_transformer"
    else:
        evaluate, task = f"fairseq-eval-lm {args.data}", "--task language_modeling --arch ts_lm"
    print(f"imported {args.source} as {args.output}; evaluate with {evaluate} --path {args.output} "
          f"--user-dir {user_dir}; train on with fairseq-train {args.data} {task} {' '.join(flags)} "
          f"--restore-file {args.output} --reset-optimizer --reset-dataloader --reset-meters ...", file=sys.stderr)


if __name__ == "__main__":
    main()
