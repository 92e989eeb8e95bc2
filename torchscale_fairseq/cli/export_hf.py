"""``ts-export-hf CHECKPOINT OUT_DIR``: a ``ts_lm``, ``ts_mlm`` or ``ts_transformer`` checkpoint (any layout: one file,
``-model_part-K`` parts, ``-shardR`` expert shards) as a Hugging Face ``transformers`` folder
(see :mod:`torchscale_fairseq.interop.hf_export`). Needs ``pip install -e .[export]``."""

from __future__ import annotations

import argparse
import sys

from torchscale_fairseq.errors import TsConfigError, install_excepthook


def main(argv: list[str] | None = None) -> None:
    install_excepthook()
    parser = argparse.ArgumentParser(prog="ts-export-hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint name, e.g. checkpoints/checkpoint_best.pt")
    parser.add_argument("out_dir", help="new folder to write (must not exist)")
    parser.add_argument("--format", default="ts",
                        help="ts (remote code, every ts_lm, ts_mlm and ts_transformer) or gpt2 (native GPT2LMHeadModel)")
    parser.add_argument("--dict", default=None,
                        help="the model's (target) dictionary (default: the checkpoint's DATA/dict.txt, or "
                        "DATA/dict.TGT.txt for a ts_transformer)")
    parser.add_argument("--spm-model", default=None,
                        help="SentencePiece model of the data, for the tokenizer (default: the task's, or DATA/spm.model)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)")
    parser.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: as saved)")
    args = parser.parse_args(argv)
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise TsConfigError(f"ts-export-hf needs {e.name}: pip install -e .[export]") from e
    import torchscale_fairseq  # noqa: F401  (registers the ts models)
    from torchscale_fairseq.interop.hf_export import export_hf

    written = export_hf(args.checkpoint, args.out_dir, args.format, args.dict, args.max_shard_size, args.dtype,
                        args.spm_model)
    print(f"exported {args.checkpoint} to {args.out_dir}: {', '.join(written)}", file=sys.stderr)


if __name__ == "__main__":
    main()
