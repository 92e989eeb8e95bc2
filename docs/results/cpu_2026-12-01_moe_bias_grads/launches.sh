#!/bin/bash
# $1: the repository to run. The launches column of benchmarks/moe_layer.py on the CPU (top-level aten ops per eager
# step: views included, which launch nothing on a GPU), bf16, grouped GEMMs, with and without --moe-compiled-routing.
cd "$1" && OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/moe_layer.py --tokens 2048 --dim 128 --ffn 256 \
  --experts 16 64 --repeats 2 --dtype bf16 --expert-gemm grouped --compiled-routing both 2>&1 | grep -E "^#|^dense|^\||^RESULT|^floor"
