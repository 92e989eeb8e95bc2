"""torchscale-fairseq: Magneto/DeepNorm backbones, X-MoE, SparseClip and Megatron-style
tensor parallelism as a fairseq plugin (``--user-dir`` this folder).

Importing the package registers the models, criterions, optimizer, BPE and tasks with
fairseq and installs the plugin into fairseq at one place,
:func:`torchscale_fairseq.integration.install.install` (upstream fixes in
:mod:`torchscale_fairseq.compat`, features in :mod:`torchscale_fairseq.integration`).
"""

from torchscale_fairseq import models  # noqa: F401  (ts_lm, ts_transformer, ts_mlm)
from torchscale_fairseq.criterions import moe_criterions  # noqa: F401  (moe_* criterions)
from torchscale_fairseq.encoders import tiktoken_gpt2  # noqa: F401  (--bpe tiktoken_gpt2)
from torchscale_fairseq.integration.install import install
from torchscale_fairseq.optim import adamw, sparse_clip  # noqa: F401  (--optimizer ts_adamw, sparse_clip)
from torchscale_fairseq.tasks import streaming_lm, streaming_mlm  # noqa: F401  (--task streaming_lm, streaming_mlm)

install()
