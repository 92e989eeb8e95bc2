"""torchscale-fairseq: Magneto/DeepNorm backbones, X-MoE, SparseClip and Megatron-style
tensor parallelism as a fairseq plugin (``--user-dir`` this folder).

Importing the package applies the fixes in :mod:`torchscale_fairseq.compat` and registers
the models, criterions, optimizer, BPE and task with fairseq.
"""

from torchscale_fairseq.compat import apply_fairseq_fixes

apply_fairseq_fixes()

from torchscale_fairseq import models  # noqa: E402,F401  (ts_lm, ts_transformer, ts_mlm)
from torchscale_fairseq.criterions import moe_criterions  # noqa: E402,F401  (moe_* criterions)
from torchscale_fairseq.encoders import tiktoken_gpt2  # noqa: E402,F401  (--bpe tiktoken_gpt2)
from torchscale_fairseq.optim import sparse_clip  # noqa: E402,F401  (--optimizer sparse_clip)
from torchscale_fairseq.tasks import streaming_lm, streaming_mlm  # noqa: E402,F401  (--task streaming_lm, streaming_mlm)
