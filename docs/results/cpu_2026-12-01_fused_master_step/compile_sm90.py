"""``--ts-fused-master-step``'s kernel compiled for sm_90 (H100, H200) by the installed Triton on a machine without a
GPU, both variants (``ALIGNED``: vector loads and stores), down to the cubin through ``ptxas``: its size, the global
loads and stores in its PTX (vector or not) and its shared memory.

    python compile_sm90.py
"""

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from torchscale_fairseq.optim.master_adamw import BLOCK
from torchscale_fairseq.optim.master_adamw_kernel import KERNELS

SIGNATURE = {"table": "*i64", "chunk_param": "*i32", "chunk_start": "*i64", "scale_ptr": "*fp32",
             "found_inf_ptr": "*fp32", "log_betas_ptr": "*fp64", "lr": "fp32", "beta1": "fp32", "beta2": "fp32",
             "eps": "fp32", "weight_decay": "fp32", "BLOCK": "constexpr", "ALIGNED": "constexpr"}


def main() -> None:
    print(f"triton {triton.__version__}, target cuda sm_90, num_warps 8, BLOCK {BLOCK}")
    for aligned in (False, True):
        source = ASTSource(fn=KERNELS["cuda"], signature=SIGNATURE, constexprs={"BLOCK": BLOCK, "ALIGNED": aligned})
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        ptx = kernel.asm["ptx"]
        counts = {kind: len(re.findall(pattern, ptx)) for kind, pattern in (
            ("vector loads", r"ld\.global(?:\.\w+)*\.v\d"), ("scalar loads", r"ld\.global(?:\.(?!v\d)\w+)*\s"),
            ("vector stores", r"st\.global(?:\.\w+)*\.v\d"), ("scalar stores", r"st\.global(?:\.(?!v\d)\w+)*\s"))}
        print(f"ALIGNED={aligned}: cubin {len(kernel.asm['cubin'])} bytes, "
              + ", ".join(f"{k} {v}" for k, v in counts.items()) + f", shared memory {kernel.metadata.shared} bytes")


if __name__ == "__main__":
    main()
