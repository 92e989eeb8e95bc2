#!/bin/bash
# $1: the repository to import the plugin from. bench-moe's MoE layer (T 8192, d 512, FFN 2048, top-2, E 64, bf16,
# grouped GEMMs) run eagerly with --compiled-routing on --compiled-experts on, compiled by inductor on the CPU under
# the GPU node's torch 2.11; each AOT graph (model__0: the routing, model__1: the experts' combine) then lowered for
# a stand-in H200 (../cpu_2026-11-30_ts_compile_pieces/fake_sm90_traffic.py): its Triton launches and the ops
# inductor leaves to PyTorch.
V=/tmp/ts-compat-matrix/py312-torch211/venv   # Python 3.12, torch 2.11.0+cu130 (the GPU node's), run on the CPU
HERE=$(cd "$(dirname "$0")" && pwd)
DUMP=$(mktemp -d)
(cd "$1" && env PYTHONPATH="$1" OMP_NUM_THREADS=2 TORCH_COMPILE_DEBUG=1 TORCH_COMPILE_DEBUG_DIR="$DUMP" \
  TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" $V/bin/python benchmarks/moe_layer.py --experts 64 --repeats 1 --dtype bf16 \
  --expert-gemm grouped --compiled-routing on --compiled-experts on > /dev/null 2>&1)
for graph in "$DUMP"/torch_compile_debug/run_*/torchinductor/model__{0,1}_{forward,backward}_*; do
  echo "== $(basename "$graph")"
  SKIP_VIEW_SCATTER=1 TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" $V/bin/python \
    "$HERE/../cpu_2026-11-30_ts_compile_pieces/fake_sm90_traffic.py" "$graph" "$(mktemp -d)" 2>&1 | tail -2
done
