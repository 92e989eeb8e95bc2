"""``ts-import-torchscale SOURCE OUTPUT --data DATA``: a TorchScale ``Decoder`` checkpoint
(Magneto ``subln`` or ``deepnorm``, dense or MoE) as a ``ts_lm`` checkpoint for ``fairseq-train --restore-file``,
``fairseq-eval-lm`` and ``ts-export-hf`` (see :mod:`torchscale_fairseq.interop.torchscale_import`)."""

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
    args = parser.parse_args(argv)
    import torchscale_fairseq  # noqa: F401  (registers the ts models)
    from torchscale_fairseq.interop.torchscale_import import import_torchscale

    flags = import_torchscale(args.source, args.output, args.data, args.positions)
    print(f"imported {args.source} as {args.output}; evaluate with fairseq-eval-lm {args.data} --path {args.output} "
          f"--user-dir {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}; train on with fairseq-train "
          f"{args.data} --task language_modeling --arch ts_lm {' '.join(flags)} --restore-file {args.output} "
          "--reset-optimizer --reset-dataloader --reset-meters ...", file=sys.stderr)


if __name__ == "__main__":
    main()
