"""Compile every Triton kernel that ``fake_sm90_traffic.py`` saved (inductor's source) with the installed Triton
for sm_90 on a machine without a GPU: each of a kernel's autotuning configs through inductor's own
``_precompile_config`` (Triton's passes down to ``ptxas``), under the same stand-in H200. Prints each kernel's
configs compiled or its error, then the counts.

    python compile_sm90.py KERNEL_DIR
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cpu_2026-11-30_ts_compile_pieces"))
import fake_sm90_traffic  # noqa: E402

fake_sm90_traffic.stand_in_device()
import torch._inductor.runtime.triton_helpers as triton_helpers  # noqa: E402

triton_helpers.set_driver_to_gpu = lambda: None  # the target is given; no driver is asked


def main(kernel_dir: Path) -> int:
    """Compile every kernel of ``kernel_dir``; 1 if any failed."""
    compiled = failed = 0
    for path in sorted(kernel_dir.glob("triton_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            kernel = next(v for k, v in vars(module).items() if k.startswith("triton_") and hasattr(v, "configs"))
            for config in kernel.configs:
                kernel._precompile_config(config)
            print(f"{path.stem}: {len(kernel.configs)} configs compiled")
            compiled += 1
        except Exception as e:  # noqa: BLE001 - every failure is reported, and the run goes on
            failed += 1
            print(f"{path.stem}: FAILED {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
    print(f"{compiled} kernels compiled for sm_90, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
