#!/bin/bash
# $1: the repository (its .venv); $2: a binarised LM data-bin (e.g. gpu_speed.py --toy's, or the suite's)
set -eu -o pipefail
cd "$1" && PYTHONPATH="$1" OMP_NUM_THREADS=1 .venv/bin/python docs/results/cpu_2026-12-01_zero_grad/zero_fills.py "$2" \
  2>/dev/null | grep "^|"
