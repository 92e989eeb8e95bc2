#!/bin/bash
# $1: the repository (its .venv, with triton); $2: a binarised LM data-bin (e.g. gpu_speed.py --toy's, or the suite's)
# traffic.txt: bytes per parameter element of the optimizer part of an update (traffic.py);
# compile_sm90.txt: the kernel compiled for sm_90 by the installed Triton (compile_sm90.py; the node has 3.6.0)
set -eu -o pipefail
cd "$1"
PYTHONPATH="$1" OMP_NUM_THREADS=1 TRITON_INTERPRET=1 .venv/bin/python docs/results/cpu_2026-12-01_fused_master_step/traffic.py "$2" \
  2>/dev/null | grep "^|"
PYTHONPATH="$1" .venv/bin/python docs/results/cpu_2026-12-01_fused_master_step/compile_sm90.py 2>/dev/null
