#!/usr/bin/env bash
# The tiny-scale comparisons of docs/results.md, as run for it (2 CPU cores shared with other jobs).
#   bash docs/results/run.sh prep|depth|width|nmt|nmt_moe|plots   (or all; WORK=/tmp/results-work)
# Two trainings run side by side (OMP_NUM_THREADS=1 each; JOBS=1 runs the stages that use `sched`
# one at a time); every run is a scripts/{lm,nmt}/*.sh recipe at SCALE=tiny with environment
# overrides, so each line below is one reproducible command.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
WORK="${WORK:-/tmp/results-work}"
export PATH="$ROOT/.venv/bin:$PATH" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 SCALE=tiny
LM_DATA="$WORK/data/enwiki_gpt2"
SPM_LM_DATA="$WORK/data/enwiki_spm4k"
JOBS="${JOBS:-2}"
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

# sched NAME SCRIPT VAR=VALUE...: `run` in the background, at most $JOBS at a time (`wait` for the rest).
sched() {
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  run "$@" &
}

# Post-LN vs DeepNorm vs Magneto at 2, 6, 18 and 50 layers, seeds 1-3: d=64 (FFN 128, 2 heads) decoder-only
# LM on the SentencePiece-4000 data, 64-token samples, 8 per update, lr DEPTH_LR with NO warm-up,
# polynomial decay to 0 over 300 updates, no clipping, no dropout; validation every 50 updates on the
# first 30 validation batches (15,360 tokens). Deepest first so that JOBS=2 packs well.
DEPTH_LR="${DEPTH_LR:-5e-3}"
DEPTH_ARGS=(DATA="$SPM_LM_DATA" EMBED_DIM=64 FFN_DIM=128 HEADS=2 LR="$DEPTH_LR" WARMUP=0 MAX_UPDATE=300
  DROPOUT=0 CLIP_NORM=0 LOG_INTERVAL=10 EXTRA_ARGS="--validate-interval-updates 50 --max-valid-steps 30")
depth_run() {  # depth_run BACKBONE LAYERS SEED (in the background, $JOBS at a time)
  sched "depth_$1_L$2_s$3" lm/train_dense.sh BACKBONE="$1" LAYERS="$2" SEED="$3" "${DEPTH_ARGS[@]}"
}
depth() {
  local layers backbone seed
  for layers in 50 18 6 2; do
    for seed in 1 2 3; do
      for backbone in postln deepnorm magneto; do depth_run "$backbone" "$layers" "$seed"; done
    done
  done
  wait
  depth_plots
}
depth_plots() {  # the 3-seed table and the mean curves (min-max band) of docs/results.md section 1
  local out="$ROOT/docs/results/depth" metric layers backbone
  mkdir -p "$out"
  python docs/results/aggregate.py "$RUNS"/depth_*_L{2,6,18,50}_s[0-9]*/ | tee "$out/table.md"
  for metric in valid_ppl train_loss gnorm; do
    for layers in 2 6 18 50; do  # the three backbones at one depth
      python docs/results/aggregate.py "$RUNS"/depth_*_L"$layers"_s[0-9]*/ --plot "$out/${metric}_L$layers.png" \
        --metric "$metric" --title "$metric, $layers layers, 3 seeds (mean, min-max band)" >/dev/null
    done
    for backbone in postln deepnorm magneto; do  # one backbone at every depth
      python docs/results/aggregate.py "$RUNS"/depth_"$backbone"_L{2,6,18,50}_s[0-9]*/ --plot "$out/${metric}_$backbone.png" \
        --metric "$metric" --title "$metric, $backbone, 3 seeds (mean, min-max band)" >/dev/null
    done
  done
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
  depth_plots
  ts-plot-logs "$RUNS"/lm_dense/train.log "$RUNS"/lm_moe16_sparse/train.log "$RUNS"/lm_moe64_sparse/train.log \
    --out-dir "$out/width"
  ts-plot-logs "$RUNS"/lm_moe64_sparse/train.log "$RUNS"/lm_moe64_vanilla/train.log --out-dir "$out/clip"
  ts-plot-logs "$RUNS"/nmt_dense/train.log "$RUNS"/nmt_moe4_sparse/train.log --out-dir "$out/nmt"
}

case "${1:-all}" in
  prep)
    python -m data_prep.prepare_lm --out-dir "$LM_DATA"
    python -m data_prep.prepare_lm --out-dir "$SPM_LM_DATA" --spm-vocab 4000
    python -m data_prep.prepare_nmt --out-dir "$NMT_DATA" --vocab-size 4000 --force ;;
  depth) depth ;;
  depth_run) depth_run "$2" "$3" "${4:-1}"; wait ;;
  depth_plots) depth_plots ;;
  width) width ;;
  nmt) nmt ;;
  nmt_moe) nmt_moe ;;
  nmt_dense_beam2) nmt_dense_beam2 ;;
  plots) plots ;;
  all) depth; width; nmt & nmt_moe; wait; plots ;;
  *) echo "usage: $0 prep|depth|depth_run BACKBONE LAYERS [SEED]|depth_plots|width|nmt|nmt_moe|nmt_dense_beam2|plots|all" >&2; exit 2 ;;
esac
