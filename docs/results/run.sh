#!/usr/bin/env bash
# The tiny-scale comparisons of docs/results.md, as run for it (2 CPU cores shared with other jobs).
#   bash docs/results/run.sh prep|depth|width|clip|nmt|nmt_moe|plots   (or all; WORK=/tmp/results-work)
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

# in_lanes FUNC ITEM...: FUNC ITEM for every ITEM (word-split: "CONFIG SEED"), in JOBS parallel lanes.
JOBS="${JOBS:-2}"
in_lanes() {
  local fn="$1" lane i
  shift
  local items=("$@")
  for ((lane = 0; lane < JOBS; lane++)); do
    { for ((i = lane; i < ${#items[@]}; i += JOBS)); do "$fn" ${items[i]}; done; } &
  done
  wait
}
SEEDS=(1 2 3)
LM_SPM_DATA="$WORK/data/enwiki_spm4k"

# Width (paper 2.1, Fig. 1b): dense vs 8 vs 32 experts at the same FLOPs per token: top-1 routing
# (each token through one expert as wide as the dense FFN), X-MoE router, MoE in every 2nd layer.
# 4-layer Magneto LM d=128 ffn=512 4 heads, SentencePiece 4000 vocabulary, 200 updates of 32 x 128
# tokens (1.2 epochs), lr 3e-3, 20 warm-up; clipping at 1.0 (SparseClip for MoE, vanilla for dense);
# validation on the whole valid split every 50 updates.
WIDTH_ARGS=(DATA="$LM_SPM_DATA" BACKBONE=magneto LAYERS=4 EMBED_DIM=128 FFN_DIM=512 HEADS=4
  TOKENS_PER_SAMPLE=128 TOTAL_BATCH=32 BATCH_SIZE=32 LR=3e-3 WARMUP=20 MAX_UPDATE=200 LOG_INTERVAL=10
  CLIP_NORM=1.0 EXTRA_ARGS="--validate-interval-updates 50")
width_run() {  # CONFIG (dense|moeE) SEED
  case "$1" in
    dense) run "width_dense_s$2" lm/train_dense.sh "${WIDTH_ARGS[@]}" SEED="$2" ;;
    moe*) run "width_$1_s$2" lm/train_moe.sh EXPERTS="${1#moe}" TOP_K=1 MOE_FREQ=2 CLIP=sparse \
      "${WIDTH_ARGS[@]}" SEED="$2" ;;
  esac
}
width() {
  local items=() c s
  for s in "${SEEDS[@]}"; do for c in dense moe8 moe32; do items+=("$c $s"); done; done
  in_lanes width_run "${items[@]}"
}

# SparseClip (paper 2.3, Fig. 3-4): a regime where expert gradients are as large as the dense ones at
# the start: 64 experts (top-2, capacity 2) in every layer, expert FFN 2048 on d=64 (4 layers, 2
# heads; 68.7M expert vs 0.33M shared parameters), 300 updates of 8 x 128 tokens, lr 3e-3, 20 warm-up,
# clip threshold 0.5 (hit by both in the first tens of updates). Vanilla clipping is the same
# sparse_clip optimizer with kappa 1 (= --optimizer adam with --clip-norm, checked: identical
# losses), so both runs log the dense and expert gradient norms.
CLIP_ARGS=(DATA="$LM_SPM_DATA" BACKBONE=magneto LAYERS=4 EMBED_DIM=64 FFN_DIM=2048 HEADS=2
  TOKENS_PER_SAMPLE=128 TOTAL_BATCH=8 BATCH_SIZE=8 LR=3e-3 WARMUP=20 MAX_UPDATE=300 LOG_INTERVAL=5
  EXPERTS=64 MOE_FREQ=1 TOP_K=2 CLIP=sparse CLIP_NORM=0.5)
clip_run() {  # CONFIG (sparse|vanilla) SEED
  local extra="--validate-interval-updates 50 --moe-capacity-factor 2"
  [ "$1" = vanilla ] && extra+=" --sparse-clip-kappa 1"
  run "clip_$1_s$2" lm/train_moe.sh "${CLIP_ARGS[@]}" SEED="$2" EXTRA_ARGS="$extra"
}
clip() {
  local items=() c s
  for s in "${SEEDS[@]}"; do for c in sparse vanilla; do items+=("$c $s"); done; done
  in_lanes clip_run "${items[@]}"
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

# Mean curves with a min-max band over the seeds (docs/results/aggregate.py), and the tables of
# docs/results.md sections 2-3.
agg_plots() {  # OUT_DIR RUN_DIR... : one PNG per metric of $AGG_METRICS
  local out="$1" m
  shift
  python docs/results/aggregate.py "$@"
  for m in $AGG_METRICS; do python docs/results/aggregate.py "$@" --plot "$out/$m.png" --metric "$m" >/dev/null; done
}
width_plots() {
  AGG_METRICS="valid_ppl train_loss routing_entropy clipping" \
    agg_plots "$ROOT/docs/results/width" "$RUNS"/width_{dense,moe8,moe32}_s*/
}
clip_plots() {
  AGG_METRICS="valid_ppl train_loss routing_entropy clipping gnorm gnorm_dense gnorm_expert" \
    agg_plots "$ROOT/docs/results/clip" "$RUNS"/clip_{sparse,vanilla}_s*/
}

# The PNGs of docs/results.md (ts-plot-logs, one directory per experiment).
plots() {
  local out="$ROOT/docs/results"
  ts-plot-logs "$RUNS"/depth_*_L24/train.log "$RUNS"/depth_*_L6/train.log --out-dir "$out/depth"
  width_plots
  clip_plots
  ts-plot-logs "$RUNS"/nmt_dense/train.log "$RUNS"/nmt_moe4_sparse/train.log --out-dir "$out/nmt"
}

case "${1:-all}" in
  prep)
    python -m data_prep.prepare_lm --out-dir "$LM_DATA"
    python -m data_prep.prepare_lm --out-dir "$LM_SPM_DATA" --spm-vocab 4000
    python -m data_prep.prepare_nmt --out-dir "$NMT_DATA" --vocab-size 4000 --force ;;
  depth) depth ;;
  depth_run) depth_run "$2" "$3" ;;
  width) width ;;
  width_run) width_run "$2" "$3" ;;
  clip) clip ;;
  clip_run) clip_run "$2" "$3" ;;
  nmt) nmt ;;
  nmt_moe) nmt_moe ;;
  nmt_dense_beam2) nmt_dense_beam2 ;;
  width_plots) width_plots ;;
  clip_plots) clip_plots ;;
  plots) plots ;;
  all) depth; width; clip; nmt & nmt_moe; wait; plots ;;
  *) echo "usage: $0 prep|depth|depth_run BACKBONE LAYERS|width|width_run CONFIG SEED|clip|clip_run CONFIG SEED|width_plots|clip_plots|nmt|nmt_moe|nmt_dense_beam2|plots|all" >&2; exit 2 ;;
esac
