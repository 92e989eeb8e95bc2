"""torchscale-fairseq: Magneto/DeepNorm backbones, X-MoE, SparseClip and Megatron-style
tensor parallelism as a fairseq plugin (``--user-dir`` this folder).

Importing the package registers the models (and criterions, optimizers, tasks) with
fairseq and applies the compatibility fixes in :mod:`torchscale_fairseq.compat`.
"""

from torchscale_fairseq.compat.distributed_cpu import patch_fairseq_distributed
from torchscale_fairseq.compat.safe_checkpoints import register_safe_globals
from torchscale_fairseq.errors import install_excepthook

register_safe_globals()
patch_fairseq_distributed()
install_excepthook()

from torchscale_fairseq import models  # noqa: E402,F401  (registers ts_lm, ts_transformer, ts_mlm)
