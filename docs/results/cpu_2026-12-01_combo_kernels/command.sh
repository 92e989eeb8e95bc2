#!/bin/bash
# $1: the repository to import the plugin from. Under the GPU node's torch 2.11 (Python 3.12, torch 2.11.0+cu130,
# Triton 3.6.0), on the CPU:
# 1. bench-moe's layer (T 8192, E 64, bf16, grouped GEMMs) with compiled routing and experts, dumped as AOT graphs
#    (model__0: the routing, model__1: the experts' combine), and the same layer at two token counts
#    (two_token_counts.py: model__2 and model__3 are the dynamic-shape entries);
# 2. each graph lowered for a stand-in H200 with combo kernels off and on (fake_sm90_traffic.py, COMBO_KERNELS):
#    its Triton launches and other ops;
# 3. the Triton kernels of each "on" lowering compiled for sm_90 by Triton (compile_sm90.py);
# 4. for comparison, a dense ts_lm_large layer under --ts-compile (1 layer, 2 x 2048 tokens), lowered both ways.
set -u -o pipefail
V=/tmp/ts-compat-matrix/py312-torch211/venv
HERE=$(cd "$(dirname "$0")" && pwd)
TOOL="$HERE/../cpu_2026-11-30_ts_compile_pieces/fake_sm90_traffic.py"
WORK=$(mktemp -d)
run() { (cd "$1" && env PYTHONPATH="$1" OMP_NUM_THREADS=2 TORCH_COMPILE_DEBUG=1 TORCH_COMPILE_DEBUG_DIR="$WORK/$2" \
  TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" "${@:3}" > "$WORK/$2.log" 2>&1) || { echo "FAILED: $2 (log $WORK/$2.log)"; exit 1; }; }
lower() {  # graph dir, label
  for combo in 0 1; do
    out="$WORK/lowered/$2_combo$combo"
    echo "== $2, combo kernels $([ $combo = 1 ] && echo on || echo off)"
    COMBO_KERNELS=$combo SKIP_VIEW_SCATTER=1 TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" $V/bin/python "$TOOL" "$1" "$out" 2>&1 | tail -1 \
      || { echo "FAILED: lowering $1"; exit 1; }
  done
  $V/bin/python "$HERE/compile_sm90.py" "$out" | tail -1 || { echo "FAILED: a kernel of $out did not compile"; exit 1; }
}
run "$1" moe $V/bin/python benchmarks/moe_layer.py --experts 64 --repeats 1 --dtype bf16 --expert-gemm grouped \
  --compiled-routing on --compiled-experts on
run "$1" moe_dynamic $V/bin/python "$HERE/two_token_counts.py"
for graph in "$WORK"/moe/torch_compile_debug/run_*/torchinductor/model__{0,1}_{forward,backward}_*; do
  lower "$graph" "static $(basename "$graph")"
done
for graph in "$WORK"/moe_dynamic/torch_compile_debug/run_*/torchinductor/model__{2,3}_{forward,backward}_*; do
  lower "$graph" "dynamic $(basename "$graph")"
done
D="$1/outputs/gpu_speed_data/data-bin"  # benchmarks/gpu_speed.py makes it where it is missing
run "$1" dense $V/bin/python "$HERE/../cpu_2026-11-30_ts_compile_pieces/dump_layer_graphs.py" "$D" \
  --task language_modeling --tokens-per-sample 2048 --sample-break-mode none --share-decoder-input-output-embed \
  --dropout 0.1 --cpu --bf16 --lr 5e-4 --batch-size 2 --disable-validation --no-save --seed 1 --num-workers 0 \
  --user-dir "$1/torchscale_fairseq" --arch ts_lm_large --decoder-layers 1 --decoder-embed-dim 1024 \
  --decoder-attention-heads 16 --decoder-ffn-embed-dim 4096 --backbone magneto --ts-fused-cross-entropy --ts-compile \
  --optimizer ts_adamw --ts-sync-free-step --max-update 1 --save-dir "$WORK/ckpt"
for graph in "$WORK"/dense/torch_compile_debug/run_*/torchinductor/model__0_{forward,backward}_*; do
  lower "$graph" "dense layer $(basename "$graph")"
done
