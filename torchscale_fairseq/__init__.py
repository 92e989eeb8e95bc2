"""torchscale-fairseq: Magneto/DeepNorm backbones, X-MoE, SparseClip and Megatron-style
tensor parallelism as a fairseq plugin (``--user-dir`` this folder).

Importing the package registers the models (and criterions, optimizers, tasks) with
fairseq and applies the compatibility fixes in :mod:`torchscale_fairseq.compat`.
"""

from torchscale_fairseq.compat.distributed_cpu import patch_fairseq_distributed
from torchscale_fairseq.compat.numpy2 import patch_numpy_compat
from torchscale_fairseq.compat.batching import patch_batching
from torchscale_fairseq.compat.checkpoint_reads import patch_checkpoint_reads
from torchscale_fairseq.compat.checkpoint_writes import patch_checkpoint_writes
from torchscale_fairseq.compat.nonfinite_skip import patch_nonfinite_skip
from torchscale_fairseq.compat.model_parallel_init import patch_fairseq_model_parallel
from torchscale_fairseq.compat.safe_checkpoints import register_safe_globals
from torchscale_fairseq.errors import install_excepthook
from torchscale_fairseq.compat.cpu_overflow import patch_overflow_on_cpu
from torchscale_fairseq.compat.expert_checkpoints import patch_trainer_expert_checkpoints
from torchscale_fairseq.modules.moe.grad_sync import patch_distributed_wrapper

patch_numpy_compat()
patch_batching()
patch_checkpoint_writes()
patch_nonfinite_skip()
register_safe_globals()
patch_fairseq_distributed()
patch_fairseq_model_parallel()
install_excepthook()
patch_trainer_expert_checkpoints()
patch_overflow_on_cpu()
patch_distributed_wrapper()
patch_checkpoint_reads()  # last: wraps the loader the patches above installed

from torchscale_fairseq import models  # noqa: E402,F401  (registers ts_lm, ts_transformer, ts_mlm)
from torchscale_fairseq.criterions import moe_criterions  # noqa: E402,F401  (registers the moe_* criterions)
from torchscale_fairseq.encoders import tiktoken_gpt2  # noqa: E402,F401  (registers --bpe tiktoken_gpt2)
from torchscale_fairseq.optim import sparse_clip  # noqa: E402,F401  (registers --optimizer sparse_clip)
from torchscale_fairseq.tasks import streaming_lm  # noqa: E402,F401  (registers --task streaming_lm)
