#!/usr/bin/env bash
# The tiny-scale comparisons of docs/results.md, as run for it (2 CPU cores shared with other jobs).
#   bash docs/results/run.sh prep|depth|width|nmt|nmt_moe|plots   (or all; WORK=/tmp/results-work)
# Two trainings run side by side (OMP_NUM_THREADS=1 each); every run is a scripts/{lm,nmt}/*.sh
# recipe at SCALE=tiny with environment overrides, so each line below is one reproducible command.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
WORK="${WORK:-/tmp/results-work}"
export PATH="$ROOT/.venv/bin:$PATH" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 SCALE=tiny
LM_DATA="$WORK/data/enwiki_gpt2"
NMT_DATA="$WORK/data/kjv_sparv_spm"
RUNS="$WORK/runs"
mkdir -p "$RUNS"

# run NAME SCRIPT VAR=VALUE...: one training, its console output in $RUNS/NAME.out (a diverged run
# that stops with non-finite gradients is a result, not an error).
run() {
  local name="$1" script="$2"
  shift 2
  env "$@" SAVE_DIR="$RUNS/$name" bash "scripts/$script" > "$RUNS/$name.out" 2>&1
  echo "$name exit $? $(date -u +%H:%M:%S)"
}

# Post-LN vs DeepNorm vs Magneto at 6 and 24 layers: d=64 decoder-only LM, aggressive lr 2e-2,
# 10 warm-up updates, 120 updates, no clipping, validation every 40 updates on 8 batches.
DEPTH_ARGS=(DATA="$LM_DATA" LR=2e-2 WARMUP=10 MAX_UPDATE=120 LOG_INTERVAL=10
  EXTRA_ARGS="--validate-interval-updates 40 --max-valid-steps 8")
depth_run() { run "depth_$1_L$2" lm/train_dense.sh BACKBONE="$1" LAYERS="$2" "${DEPTH_ARGS[@]}"; }
depth() {
  { depth_run postln 24; depth_run deepnorm 24; } &
  { depth_run magneto 24; depth_run postln 6; depth_run magneto 6; depth_run deepnorm 6; } &
  wait
}

# Dense vs 16 vs 64 experts (X-MoE top-2, every 2nd layer, SparseClip), and 64 experts with vanilla
# clipping: 4-layer d=64 Magneto LM, lr 5e-3, 20 warm-up, 100 updates, clip norm 1.0 everywhere.
MOE_ARGS=(DATA="$LM_DATA" BACKBONE=magneto LAYERS=4 LR=5e-3 WARMUP=20 MAX_UPDATE=100 LOG_INTERVAL=10
  CLIP_NORM=1.0 EXTRA_ARGS="--validate-interval-updates 50 --max-valid-steps 8")
width() {
  { run lm_dense lm/train_dense.sh "${MOE_ARGS[@]}"; run lm_moe64_sparse lm/train_moe.sh EXPERTS=64 CLIP=sparse "${MOE_ARGS[@]}"; } &
  { run lm_moe16_sparse lm/train_moe.sh EXPERTS=16 CLIP=sparse "${MOE_ARGS[@]}"; run lm_moe64_vanilla lm/train_moe.sh EXPERTS=64 CLIP=vanilla "${MOE_ARGS[@]}"; } &
  wait
}

# Dense vs X-MoE NMT, 2-2 layers d=128, 300 updates of 2048 tokens, lr 3e-3, 60 warm-up: the MoE run
# is the translation recipe of `bash scripts/demo.sh` (4 experts, SparseClip); the dense run is the
# same recipe without experts.
# Both are scored with beam 4 and --no-repeat-ngram-size 3 (the demo's defaults); the dense model also
# with the old demo setting (beam 2, no n-gram blocking).
NMT_ARGS=(DATA="$NMT_DATA" EMBED_DIM=128 FFN_DIM=256 HEADS=4 MAX_TOKENS=2048 TOTAL_TOKENS=2048
  LR=3e-3 WARMUP=60 MAX_UPDATE=300 LOG_INTERVAL=20 EXTRA_ARGS="--validate-interval-updates 100")
nmt() {
  run nmt_dense nmt/train_dense.sh "${NMT_ARGS[@]}"
  env SCALE=tiny DATA="$NMT_DATA" SAVE_DIR="$RUNS/nmt_dense" BEAM=4 \
    EXTRA_ARGS="--no-repeat-ngram-size 3" bash scripts/nmt/evaluate.sh
  nmt_dense_beam2
}
nmt_dense_beam2() {  # the old demo setting: beam 2, no n-gram blocking
  mkdir -p "$RUNS/nmt_dense_beam2"
  ln -sf "$RUNS/nmt_dense/checkpoint_best.pt" "$RUNS/nmt_dense/train.log" "$RUNS/nmt_dense_beam2/"
  env SCALE=tiny DATA="$NMT_DATA" SAVE_DIR="$RUNS/nmt_dense_beam2" BEAM=2 bash scripts/nmt/evaluate.sh
}
nmt_moe() {  # the demo's NMT recipe (scripts/demo.sh step 5) on the data of `prep`
  run nmt_moe4_sparse nmt/train_moe.sh EXPERTS=4 CLIP=sparse "${NMT_ARGS[@]}"
  env SCALE=tiny DATA="$NMT_DATA" SAVE_DIR="$RUNS/nmt_moe4_sparse" BEAM=4 \
    EXTRA_ARGS="--no-repeat-ngram-size 3" bash scripts/nmt/evaluate.sh
}

# The PNGs of docs/results.md (ts-plot-logs, one directory per experiment).
plots() {
  local out="$ROOT/docs/results"
  ts-plot-logs "$RUNS"/depth_*_L24/train.log "$RUNS"/depth_*_L6/train.log --out-dir "$out/depth"
  ts-plot-logs "$RUNS"/lm_dense/train.log "$RUNS"/lm_moe16_sparse/train.log "$RUNS"/lm_moe64_sparse/train.log \
    --out-dir "$out/width"
  ts-plot-logs "$RUNS"/lm_moe64_sparse/train.log "$RUNS"/lm_moe64_vanilla/train.log --out-dir "$out/clip"
  ts-plot-logs "$RUNS"/nmt_dense/train.log "$RUNS"/nmt_moe4_sparse/train.log --out-dir "$out/nmt"
}

case "${1:-all}" in
  prep)
    python -m data_prep.prepare_lm --out-dir "$LM_DATA"
    python -m data_prep.prepare_nmt --out-dir "$NMT_DATA" --vocab-size 4000 --force ;;
  depth) depth ;;
  depth_run) depth_run "$2" "$3" ;;
  width) width ;;
  nmt) nmt ;;
  nmt_moe) nmt_moe ;;
  nmt_dense_beam2) nmt_dense_beam2 ;;
  plots) plots ;;
  all) depth; width; nmt & nmt_moe; wait; plots ;;
  *) echo "usage: $0 prep|depth|depth_run BACKBONE LAYERS|width|nmt|nmt_moe|nmt_dense_beam2|plots|all" >&2; exit 2 ;;
esac
