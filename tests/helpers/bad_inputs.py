"""The bad-input matrix: each case is a command that must exit non-zero with one line
naming the problem (``expect``) and the fix, write nothing and overwrite nothing.

``render_troubleshooting()`` gives the README's troubleshooting table; a test keeps the
two in step.
"""

from dataclasses import dataclass
from typing import Callable, List

from tests.helpers.cli_utils import LM_TRAIN, MT_TRAIN, USER_DIR, tool


@dataclass(frozen=True)
class Case:
    name: str
    area: str
    expect: str
    fix: str
    command: Callable[[dict], List[str]]


def _lm(ctx, *flags, data="lm_data", arch="ts_lm_tiny"):
    return [tool("fairseq-train"), ctx[data], "--user-dir", USER_DIR, "--arch", arch, "--max-update",
            "2", "--save-dir", ctx["save"], *LM_TRAIN, *flags]


def _mt(ctx, data_key="mt_data", *flags):
    return [tool("fairseq-train"), ctx[data_key], "--user-dir", USER_DIR, "--arch", "ts_transformer_tiny",
            "--max-update", "2", "--save-dir", ctx["save"], *MT_TRAIN, *flags]


def _eval_lm(ctx, checkpoint_key, data_key="lm_data"):
    return [tool("fairseq-eval-lm"), ctx[data_key], "--path", ctx[checkpoint_key], "--user-dir", USER_DIR, "--cpu",
            "--tokens-per-sample", "32"]


CASES = [
    Case("missing data directory", "data", "No such file or directory", "check the data directory",
         lambda c: _lm(c, data="missing_dir")),
    Case("empty data directory", "data", "dict.txt", "create it with fairseq-preprocess",
         lambda c: _lm(c, data="empty_dir")),
    Case("data directory without the train split", "data", "Dataset not found", "fairseq-preprocess",
         lambda c: _lm(c, data="no_train_dir")),
    Case("dictionary differs from the checkpoint (resume)", "checkpoint", "the checkpoint's dictionary has",
         "use the dict.txt the checkpoint was trained with",
         lambda c: _lm(c, "--restore-file", c["lm_ckpt"], data="other_lm_data")),
    Case("dictionary differs from the checkpoint (eval-lm)", "checkpoint", "the checkpoint's dictionary has",
         "use the dict.txt the checkpoint was trained with", lambda c: _eval_lm(c, "lm_ckpt", "other_lm_data")),
    Case("corrupt checkpoint file", "checkpoint", "is corrupt or truncated", "restore it from a copy",
         lambda c: _eval_lm(c, "corrupt_ckpt")),
    Case("truncated checkpoint file", "checkpoint", "is corrupt or truncated", "restore it from a copy",
         lambda c: _eval_lm(c, "truncated_ckpt")),
    Case("checkpoint whose pickle would run code", "checkpoint", "refused to load", "trust",
         lambda c: _eval_lm(c, "evil_ckpt")),
    Case("unknown backbone", "flags", "--backbone", "choose from", lambda c: _lm(c, "--backbone", "sandwich")),
    Case("unknown activation", "flags", "--activation-fn", "choose from", lambda c: _lm(c, "--activation-fn", "elu")),
    Case("unknown checkpoint-activations mode", "flags", "--checkpoint-activations", "choose from",
         lambda c: _lm(c, "--checkpoint-activations", "nope")),
    Case("embedding dim not divisible by heads", "flags", "not divisible by 8 attention heads",
         "multiple of --*-attention-heads", lambda c: _lm(c, "--decoder-embed-dim", "100",
                                                          "--decoder-attention-heads", "8")),
    Case("DeepNorm with a Pre-LN flag", "flags", "--decoder-normalize-before asks for Pre-LN",
         "use --backbone preln", lambda c: _lm(c, "--backbone", "deepnorm", "--decoder-normalize-before")),
    Case("DeepNorm with an embedding LayerNorm", "flags", "cannot honour --layernorm-embedding", "drop the flag",
         lambda c: _lm(c, "--backbone", "deepnorm", "--layernorm-embedding")),
    Case("Post-LN with a Pre-LN flag (encoder)", "flags", "--encoder-normalize-before asks for Pre-LN",
         "use --backbone preln", lambda c: _mt(c, "mt_data", "--backbone", "postln", "--encoder-normalize-before")),
    Case("two relative position schemes", "flags", "--xpos and --rel-pos-buckets", "choose one",
         lambda c: _lm(c, "--xpos", "--rel-pos-buckets", "32")),
    Case("LM samples longer than the positions", "flags", "--tokens-per-sample 64 is longer than",
         "raise --max-target-positions", lambda c: _lm(c, "--tokens-per-sample", "64",
                                                       "--max-target-positions", "32")),
    Case("source sentences longer than the positions", "data", "is invalid", "--skip-invalid-size-inputs-valid-test",
         lambda c: _mt(c, "mt_data", "--max-source-positions", "6")),
    Case("shared embeddings with two dictionaries", "flags", "--share-all-embeddings needs one dictionary",
         "--joined-dictionary", lambda c: _mt(c, "mt_split_data")),
    Case("shared embeddings with different widths", "flags", "--share-all-embeddings needs --encoder-embed-dim",
         "equal to --decoder-embed-dim", lambda c: _mt(c, "mt_data", "--encoder-embed-dim", "64")),
]


CASES += [
    Case("more experts per token than supported", "flags", "--moe-top-k 9 is not supported", "use 1 to 8",
         lambda c: _lm(c, "--moe-expert-count", "16", "--moe-top-k", "9")),
    Case("auxiliary-loss-free bias on expert-choice routing", "flags", "--moe-router-bias-update-rate biases",
         "use a token-choice router",
         lambda c: _lm(c, "--moe-expert-count", "2", "--moe-top-k", "1", "--moe-router", "expert_choice",
                       "--moe-router-bias-update-rate", "0.001")),
    Case("expert parallel size larger than the processes", "flags", "--moe-expert-parallel-size 2 does not divide",
         "use a divisor", lambda c: _lm(c, "--moe-expert-count", "4", "--moe-expert-parallel-size", "2")),
    Case("MoE layer frequency 0", "flags", "--moe-freq 0 must be positive", "positive",
         lambda c: _lm(c, "--moe-expert-count", "2", "--moe-freq", "0")),
    Case("MoE model with a criterion that ignores the balance loss", "flags", "without their balance loss",
         "--criterion moe_cross_entropy", lambda c: _lm(c, "--moe-expert-count", "2")),
    Case("tensor-parallel size larger than the world", "flags", "--model-parallel-size 2", "--distributed-world-size",
         lambda c: _lm(c, "--model-parallel-size", "2")),
    Case("pipeline size larger than the world", "flags", "--pipeline-model-parallel-size 2 needs a multi-process run",
         "launch them with torchrun", lambda c: _lm(c, "--pipeline-model-parallel-size", "2")),
    Case("virtual pipeline stages without a pipeline", "flags", "--virtual-pipeline-stages 2 splits the layers",
         "raise the pipeline size", lambda c: _lm(c, "--virtual-pipeline-stages", "2")),
    Case("position reset on fairseq's language_modeling blocks", "flags",
         "--reset-positions-at-documents needs blocks that carry their documents",
         "--document-masking with --task streaming_lm", lambda c: _lm(c, "--reset-positions-at-documents")),
    Case("sharded optimizer state on one process", "flags", "--zero-sharding os shards the optimizer state",
         "drop --zero-sharding or train on more ranks", lambda c: _lm(c, "--zero-sharding", "os")),
    Case("consolidating shards of different runs", "checkpoint", "one of", "shards",
         lambda c: [tool("ts-consolidate-experts"), c["lm_ckpt"], c["lm_ckpt"], "-o", f"{c['save']}/merged.pt"]),
    Case("resharding a checkpoint that does not exist", "checkpoint", "no checkpoint", "check --input",
         lambda c: [tool("ts-reshard"), "--input", f"{c['missing_dir']}/checkpoint_last.pt", "--size", "2",
                    "--output", f"{c['save']}/resharded.pt"]),
    Case("resharding to a size the heads do not divide", "checkpoint", "cannot be split", "--model-parallel-size",
         lambda c: [tool("ts-reshard"), "--input", c["lm_ckpt"], "--size", "3", "--output",
                    f"{c['save']}/resharded.pt"]),
]


def render_troubleshooting() -> str:
    rows = ["| area | you did | the error says | fix |", "|---|---|---|---|"]
    rows += [f"| {c.area} | {c.name} | `{c.expect}` | {c.fix} |" for c in CASES]
    return "\n".join(rows)
