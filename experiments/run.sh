#!/usr/bin/env bash
# The tiny-scale comparisons of docs/results.md, as run for it (2 CPU cores shared with other jobs).
#   bash experiments/run.sh prep|depth|stability|deeper|width|clip|clipscale|clipedge|nmt|nmtdeep|nmtdeep_control|nmtlong BACKBONE|source_use|source_use_timing|nmtwarm|routing|plots   (or all; WORK=/tmp/results-work)
# Every stage runs its trainings JOBS at a time (default 2, OMP_NUM_THREADS=1 each; JOBS=1: one after
# the other); every run is a scripts/{lm,nmt}/*.sh recipe at SCALE=tiny with environment overrides,
# so each line below is one reproducible command.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="$ROOT/docs/results"  # the tables and plots that docs/results.md cites
cd "$ROOT"
WORK="${WORK:-/tmp/results-work}"
export PATH="$ROOT/.venv/bin:$PATH" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 SCALE=tiny
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

# sched COMMAND...: COMMAND in the background, at most $JOBS at a time (`wait` for the rest).
sched() {
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  "$@" &
}
SEEDS=(1 2 3)

# Post-LN vs DeepNorm vs Magneto at 2, 6, 18 and 50 layers, seeds 1-3: d=64 (FFN 128, 2 heads) decoder-only
# LM on the SentencePiece-4000 data, 64-token samples, 8 per update, lr DEPTH_LR with NO warm-up,
# polynomial decay to 0 over 300 updates, no clipping, no dropout; validation every 50 updates on the
# first 30 validation batches (15,360 tokens). Deepest first so that JOBS=2 packs well.
DEPTH_LR="${DEPTH_LR:-5e-3}"
DEPTH_ARGS=(DATA="$SPM_LM_DATA" EMBED_DIM=64 FFN_DIM=128 HEADS=2 LR="$DEPTH_LR" WARMUP=0 MAX_UPDATE=300
  DROPOUT=0 CLIP_NORM=0 LOG_INTERVAL=10 EXTRA_ARGS="--validate-interval-updates 50 --max-valid-steps 30")
depth_run() {  # depth_run BACKBONE LAYERS SEED (in the background, $JOBS at a time)
  sched run "depth_$1_L$2_s$3" lm/train_dense.sh BACKBONE="$1" LAYERS="$2" SEED="$3" "${DEPTH_ARGS[@]}"
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
  local out="$RESULTS/depth" metric layers backbone
  mkdir -p "$out"
  python experiments/aggregate.py "$RUNS"/depth_*_L{2,6,18,50}_s[0-9]*/ --runs-jsonl "$out/runs.jsonl" | tee "$out/table.md"
  for metric in valid_ppl train_loss gnorm; do
    for layers in 2 6 18 50; do  # the three backbones at one depth
      python experiments/aggregate.py "$RUNS"/depth_*_L"$layers"_s[0-9]*/ --plot "$out/${metric}_L$layers.png" \
        --metric "$metric" --title "$metric, $layers layers, 3 seeds (mean, min-max band)" >/dev/null
    done
    for backbone in postln deepnorm magneto; do  # one backbone at every depth
      python experiments/aggregate.py "$RUNS"/depth_"$backbone"_L{2,6,18,50}_s[0-9]*/ --plot "$out/${metric}_$backbone.png" \
        --metric "$metric" --title "$metric, $backbone, 3 seeds (mean, min-max band)" >/dev/null
    done
  done
}

# Stability in DeepNet's regime (issue 25 item 1): Post-LN vs DeepNorm vs Magneto vs Pre-LN with a standard
# warm-up, the depth stage's model and data otherwise (d=64, FFN 128, 2 heads, SentencePiece-4000,
# 8 x 64 tokens per update, no clipping, no dropout): 1000 updates (0.76 epoch), 100 warm-up (10%),
# polynomial decay to 0, validation every 250 updates on the first 30 validation batches.
# Criteria, fixed before the runs (experiments/stability.py): diverged = non-finite, or a final
# training loss > 1 bit above its minimum; stalled = final validation ppl not 10% below the unigram
# model's on those tokens (687, section 1); trains = neither. lr_max = the largest grid lr that trains.
# The default is the slice a 45-minute stage holds (24 runs: 6 and 18 layers at lr 2e-3, chosen on a
# one-seed validation pilot); the map is the same stage over the x2 grid and more depths, e.g.
#   STAB_LRS="5e-4 1e-3 2e-3 4e-3 8e-3 1.6e-2 3.2e-2" STAB_DEPTHS="50 18 6" bash experiments/run.sh stability
STAB_LRS="${STAB_LRS:-2e-3}"
STAB_DEPTHS="${STAB_DEPTHS:-18 6}"
STAB_UNIGRAM_PPL=687
STAB_ARGS=(DATA="$SPM_LM_DATA" EMBED_DIM=64 FFN_DIM=128 HEADS=2 WARMUP=100 MAX_UPDATE=1000 DROPOUT=0
  CLIP_NORM=0 LOG_INTERVAL=50 EXTRA_ARGS="--validate-interval-updates 250 --max-valid-steps 30")
stability() {
  local layers seed lr backbone
  for layers in $STAB_DEPTHS; do
    for seed in "${SEEDS[@]}"; do
      for lr in $STAB_LRS; do
        for backbone in postln deepnorm magneto preln; do
          sched run "stab_${backbone}_L${layers}_lr${lr}_s${seed}" lm/train_dense.sh BACKBONE="$backbone" \
            LAYERS="$layers" LR="$lr" SEED="$seed" "${STAB_ARGS[@]}"
        done
      done
    done
  done
  wait
  stability_report
}
# The lr_max map as a search (issue 25 item 1): per backbone, depth and seed, from lr 2e-3 along the x2
# grid STAB_GRID, upwards while the run trains, downwards while it does not, stopping at the first
# change of outcome; lr_max = the largest lr that trains (assumed, as in DeepNet's and Magneto's
# sweeps: a rate below one that trains also trains, and one above a failure also fails). Runs already
# in $RUNS (the stability stage's, an interrupted search's) are read, not run again.
STAB_GRID=(5e-4 1e-3 2e-3 4e-3 8e-3 1.6e-2 3.2e-2)
STAB_START=2  # index of 2e-3 in STAB_GRID
stab_outcome() {  # BACKBONE LAYERS LR SEED: train the cell if it has no finished run, print its outcome
  local name="stab_${1}_L${2}_lr${3}_s${4}"
  grep -qs "done training\|FloatingPointError\|Nan/Inf\|nan or inf\|non-finite" "$RUNS/$name/train.log" ||
    run "$name" lm/train_dense.sh BACKBONE="$1" LAYERS="$2" LR="$3" SEED="$4" "${STAB_ARGS[@]}" >&2
  python experiments/stability.py "$RUNS/$name" --unigram "$STAB_UNIGRAM_PPL" --outcome
}
stability_search_cell() {  # BACKBONE LAYERS SEED
  local i="$STAB_START" first
  first="$(stab_outcome "$1" "$2" "${STAB_GRID[$i]}" "$3")"
  if [ "$first" = trains ]; then
    while [ $((i + 1)) -lt ${#STAB_GRID[@]} ]; do
      i=$((i + 1))
      [ "$(stab_outcome "$1" "$2" "${STAB_GRID[$i]}" "$3")" = trains ] || break
    done
  else
    while [ "$i" -gt 0 ]; do
      i=$((i - 1))
      [ "$(stab_outcome "$1" "$2" "${STAB_GRID[$i]}" "$3")" = trains ] && break
    done
  fi
  echo "search $1 L$2 s$3 done $(date -u +%H:%M:%S)"
}
# STAB_SEEDS and STAB_BACKBONES narrow the search to what a stage holds, e.g. 50 layers, seed 1:
#   STAB_DEPTHS=50 STAB_SEEDS=1 STAB_BACKBONES="postln deepnorm" bash experiments/run.sh stability_search
STAB_SEEDS="${STAB_SEEDS:-${SEEDS[*]}}"
STAB_BACKBONES="${STAB_BACKBONES:-postln deepnorm magneto preln}"
stability_search() {
  local layers seed backbone
  for layers in $STAB_DEPTHS; do
    for seed in $STAB_SEEDS; do
      for backbone in $STAB_BACKBONES; do sched stability_search_cell "$backbone" "$layers" "$seed"; done
    done
  done
  wait
  STAB_LRS="${STAB_GRID[*]}" stability_report
}
# stability_report: the outcome table and lr_max against depth over every run recorded in
# docs/results/stability/runs.jsonl (the stab_* runs in $RUNS are added to it first, so runs made on
# several machines add up), then the validation curves per depth and lr of the runs in $RUNS, and their
# runs (runs_L<layers>_lr<lr>.jsonl: validations, training loss and gradient norm per logged update).
stability_report() {
  local out="$RESULTS/stability" layers lr runs
  mkdir -p "$out"
  mapfile -t runs < <(compgen -G "$RUNS/stab_*_s[0-9]*/")
  python experiments/stability.py "${runs[@]}" --records "$out/runs.jsonl" --unigram "$STAB_UNIGRAM_PPL" \
    --plot "$out/lr_max.png" > "$out/table.md.new" || { rm -f "$out/table.md.new"; return 1; }
  mv "$out/table.md.new" "$out/table.md" && cat "$out/table.md"
  for layers in $STAB_DEPTHS; do
    for lr in $STAB_LRS; do  # (a search runs only part of the grid)
      compgen -G "$RUNS/stab_*_L${layers}_lr${lr}_s[0-9]*/" > /dev/null || continue
      python experiments/aggregate.py "$RUNS"/stab_*_L"${layers}"_lr"${lr}"_s[0-9]*/ --plot "$out/valid_ppl_L${layers}_lr${lr}.png" \
        --metric valid_ppl --title "valid ppl, $layers layers, lr $lr (mean, min-max band)" \
        --runs-jsonl "$out/runs_L${layers}_lr${lr}.jsonl" --merge >/dev/null  # every run's validations and updates
    done
  done
}

# Deeper at a budget where depth pays (issue 25 item 4): Magneto at 6 and 18 layers, d=128 (FFN 512,
# 4 heads), 2000 updates of 8 x 64 tokens (1.5 epochs of the SentencePiece-4000 data), 200 warm-up
# (10%), lr 2e-3 (a rate at which Magneto trains at 18 layers in the stability stage), polynomial decay
# to 0, no clipping, no dropout; validation every 250 updates on the first 30 validation batches.
# 18 layers first so that JOBS=2 packs well; 50 layers (2.7x an 18-layer run) is outside one stage.
DEEPER_DEPTHS="${DEEPER_DEPTHS:-18 6}"
DEEPER_ARGS=(DATA="$SPM_LM_DATA" BACKBONE=magneto EMBED_DIM=128 FFN_DIM=512 HEADS=4 LR=2e-3 WARMUP=200
  MAX_UPDATE=2000 DROPOUT=0 CLIP_NORM=0 LOG_INTERVAL=50
  EXTRA_ARGS="--validate-interval-updates 250 --max-valid-steps 30")
deeper() {
  local layers seed
  for layers in $DEEPER_DEPTHS; do
    for seed in "${SEEDS[@]}"; do
      sched run "deeper_magneto_L${layers}_s${seed}" lm/train_dense.sh LAYERS="$layers" SEED="$seed" "${DEEPER_ARGS[@]}"
    done
  done
  wait
  deeper_plots
}
deeper_plots() {  # the 3-seed table and the validation / training curves of docs/results.md section 9
  local out="$RESULTS/deeper" metric
  mkdir -p "$out"
  python experiments/aggregate.py "$RUNS"/deeper_magneto_L*_s[0-9]*/ --runs-jsonl "$out/runs.jsonl" | tee "$out/table.md"
  for metric in valid_ppl train_loss; do
    python experiments/aggregate.py "$RUNS"/deeper_magneto_L*_s[0-9]*/ --plot "$out/$metric.png" \
      --metric "$metric" --title "Magneto d=128, 6 vs 18 layers, $metric (3 seeds)" >/dev/null
  done
}

# Width (paper 2.1, Fig. 1b): dense vs 8 vs 32 experts at the same FLOPs per token: top-1 routing
# (each token through one expert as wide as the dense FFN), X-MoE router, MoE in every 2nd layer.
# 4-layer Magneto LM d=128 ffn=512 4 heads, SentencePiece 4000 vocabulary, 200 updates of 32 x 128
# tokens (1.2 epochs), lr 3e-3, 20 warm-up; clipping at 1.0 (SparseClip for MoE, vanilla for dense);
# validation on the whole valid split every 50 updates.
WIDTH_ARGS=(DATA="$SPM_LM_DATA" BACKBONE=magneto LAYERS=4 EMBED_DIM=128 FFN_DIM=512 HEADS=4
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
  local c s
  for s in "${SEEDS[@]}"; do for c in dense moe8 moe32; do sched width_run "$c" "$s"; done; done
  wait
}

# SparseClip (paper 2.3, Fig. 3-4): a regime where expert gradients are as large as the dense ones at
# the start: 64 experts (top-2, capacity 2) in every layer, expert FFN 2048 on d=64 (4 layers, 2
# heads; 68.7M expert vs 0.33M shared parameters), 300 updates of 8 x 128 tokens, lr 3e-3, 20 warm-up,
# clip threshold 0.5 (hit by both in the first tens of updates). Vanilla clipping is the same
# sparse_clip optimizer with kappa 1 (= --optimizer adam with --clip-norm, checked: identical
# losses), so both runs log the dense and expert gradient norms.
CLIP_ARGS=(DATA="$SPM_LM_DATA" BACKBONE=magneto LAYERS=4 EMBED_DIM=64 FFN_DIM=2048 HEADS=2
  TOKENS_PER_SAMPLE=128 TOTAL_BATCH=8 BATCH_SIZE=8 LR=3e-3 WARMUP=20 MAX_UPDATE=300 LOG_INTERVAL=5
  EXPERTS=64 MOE_FREQ=1 TOP_K=2 CLIP=sparse CLIP_NORM=0.5)
clip_run() {  # CONFIG (sparse|vanilla) SEED
  local extra="--validate-interval-updates 50 --moe-capacity-factor 2"
  [ "$1" = vanilla ] && extra+=" --sparse-clip-kappa 1"
  run "clip_$1_s$2" lm/train_moe.sh "${CLIP_ARGS[@]}" SEED="$2" EXTRA_ARGS="$extra"
}
clip() {
  local c s
  for s in "${SEEDS[@]}"; do for c in sparse vanilla; do sched clip_run "$c" "$s"; done; done
  wait
}

# SparseClip at the stability edge (issue 25 item 3): the clip stage's model and batch (64 experts of width
# 2048 in every layer, top-2, capacity 2), logged every update, at CLIPEDGE_LR = the largest lr of the x2
# grid 1.6e-2 .. 1.28e-1 that trains WITHOUT clipping in a pilot (seed 4, not reported: 6.4e-2 trains,
# 1.28e-1 stalls), and a threshold CLIPEDGE_NORM = the 10th percentile of that pilot's SparseClip norm over
# updates 21-300 (0.138), so that clipping is active on about 90% of the updates. Three arms: SparseClip
# (kappa 1/sqrt(64)), vanilla (kappa 1) and no clipping; seeds 1-3. Spikes, divergence and stalls as
# summarize.py / stability.py define them (stalled: final validation ppl >= 0.9 x 659.3, the unigram
# model's on the whole validation split).
CLIPEDGE_LR="${CLIPEDGE_LR:-6.4e-2}"
CLIPEDGE_NORM="${CLIPEDGE_NORM:-0.138}"
clipedge_run() {  # CONFIG (sparse|vanilla|noclip) SEED
  local extra="--validate-interval-updates 50 --moe-capacity-factor 2" norm="$CLIPEDGE_NORM"
  case "$1" in
    sparse) ;;
    vanilla) extra+=" --sparse-clip-kappa 1" ;;
    noclip) norm=0 ;;
    *) echo "clipedge_run: unknown config $1 (sparse|vanilla|noclip)" >&2; return 2 ;;
  esac
  run "clipedge_$1_s$2" lm/train_moe.sh "${CLIP_ARGS[@]}" SEED="$2" LR="$CLIPEDGE_LR" CLIP_NORM="$norm" \
    LOG_INTERVAL=1 EXTRA_ARGS="$extra"
}
clipedge() {
  local c s
  for s in "${SEEDS[@]}"; do for c in sparse vanilla noclip; do sched clipedge_run "$c" "$s"; done; done
  wait
  clipedge_plots
}
clipedge_plots() {
  mkdir -p "$RESULTS/clipedge"
  AGG_METRICS="valid_ppl train_loss clipping gnorm gnorm_dense gnorm_expert" \
    agg_plots "$RESULTS/clipedge" "$RUNS"/clipedge_{sparse,vanilla,noclip}_s*/ | tee "$RESULTS/clipedge/table.md"
}

# SparseClip's premise against E (issue 25 item 3): the expert / dense gradient-norm ratio for E = 8 ..
# 256 experts in every layer, the clip stage's model otherwise (4-layer Magneto d=64, top-2, capacity 2,
# lr 3e-3, 20 warm-up) with experts 256 wide so that E = 256 fits (34.4M expert parameters), 100 updates
# of 8 x 128 tokens logged every update, NO clipping (the natural norms), no validation; the ratio
# and its power-law fit by experiments/grad_norm_scaling.py.
CLIPSCALE_ARGS=(DATA="$SPM_LM_DATA" BACKBONE=magneto LAYERS=4 EMBED_DIM=64 FFN_DIM=256 HEADS=2
  TOKENS_PER_SAMPLE=128 TOTAL_BATCH=8 BATCH_SIZE=8 LR=3e-3 WARMUP=20 MAX_UPDATE=100 LOG_INTERVAL=1
  MOE_FREQ=1 TOP_K=2 CLIP=sparse CLIP_NORM=0 EXTRA_ARGS="--moe-capacity-factor 2 --disable-validation")
clipscale() {
  local e s
  for s in "${SEEDS[@]}"; do
    for e in 256 128 64 32 16 8; do sched run "clipscale_E${e}_s$s" lm/train_moe.sh "${CLIPSCALE_ARGS[@]}" EXPERTS="$e" SEED="$s"; done
  done
  wait
  clipscale_plots
}
clipscale_plots() {  # section 8's table and plot, and the runs behind them (every update's gnorm_dense / gnorm_expert)
  mkdir -p "$RESULTS/clip"
  python experiments/aggregate.py --moe "$RUNS"/clipscale_E*_s[0-9]*/ --runs-jsonl "$RESULTS/clip/norm_ratio_runs.jsonl" >/dev/null
  python experiments/grad_norm_scaling.py --records "$RESULTS/clip/norm_ratio_runs.jsonl" \
    --plot "$RESULTS/clip/norm_ratio_vs_experts.png" | tee "$RESULTS/clip/norm_ratio_vs_experts.md"
}

# Dense vs X-MoE NMT at the same FLOPs per token (paper 2.2, Fig. 2): top-1 routing sends each token
# through one expert FFN the size of the dense FFN, so 16 experts add parameters, not compute.
# The demo's translation recipe otherwise: 2-2 layers d=128, FFN 512, experts in every 2nd layer,
# SparseClip (vanilla clipping for the dense model, same threshold 1.0), no dropout, 600 updates of
# 2048 tokens, lr 5e-3 inverse sqrt after 60 warm-up updates; seeds 1-3; test BLEU/chrF with beam 4
# and --no-repeat-ngram-size 3 (the demo's decoding).
NMT_ARGS=(DATA="$NMT_DATA" EMBED_DIM=128 FFN_DIM=512 HEADS=4 DROPOUT=0.0 MAX_TOKENS=2048 TOTAL_TOKENS=2048
  LR=5e-3 WARMUP=60 MAX_UPDATE=600 LOG_INTERVAL=50 EXTRA_ARGS="--validate-interval-updates 200")
nmt_eval() {
  env SCALE=tiny DATA="$NMT_DATA" SAVE_DIR="$RUNS/$1" BEAM=4 EXTRA_ARGS="--no-repeat-ngram-size 3" \
    bash scripts/nmt/evaluate.sh > "$RUNS/$1.eval.out" 2>&1
}
nmt_run() {  # CONFIG SEED: one training and its test score
  local name="nmt_$1_s$2"
  case "$1" in
    dense) run "$name" nmt/train_dense.sh SEED="$2" "${NMT_ARGS[@]}" ;;
    moe*) run "$name" nmt/train_moe.sh EXPERTS="${1#moe}" TOP_K=1 CLIP=sparse SEED="$2" "${NMT_ARGS[@]}" ;;
  esac
  nmt_eval "$name"
}
nmt() {
  local c s
  for s in "${SEEDS[@]}"; do for c in dense moe16; do sched nmt_run "$c" "$s"; done; done
  wait
}

# DeepNet's own setting, shrunk (issue 25 item 2): the nmt stage's translation data and schedule (600 updates
# of 2,048 tokens, about one epoch; inverse-sqrt decay after 60 warm-up updates, 10%; label smoothing 0.1;
# clipping at 1.0, the recipe's; no dropout) with a deep, narrow dense model: NMTDEEP_LAYERS-NMTDEEP_LAYERS
# layers (18-18), d=64, FFN 256 (4d, as in the paper), 4 heads, lr NMTDEEP_LR (2e-3: chosen on seed-4
# pilots, docs/results.md section 12). Validation on the whole validation split every 200 updates.
# Stalled: final validation ppl not 10% below the unigram model of the target side (461.8:
# python -m data_prep.unigram_ppl DATA --pair en-es); diverged as summarize.py says. Test BLEU / chrF as
# in the nmt stage (beam 4, --no-repeat-ngram-size 3), once per run after training. A run whose test
# score exists is not run again (an interrupted stage resumes).
NMTDEEP_LAYERS="${NMTDEEP_LAYERS:-18}"
NMTDEEP_LR="${NMTDEEP_LR:-2e-3}"
NMTDEEP_UPDATES="${NMTDEEP_UPDATES:-600}"
NMTDEEP_VALID_EVERY="${NMTDEEP_VALID_EVERY:-200}"
NMTDEEP_ARGS=(DATA="$NMT_DATA" EMBED_DIM=64 FFN_DIM=256 HEADS=4 DROPOUT=0.0 MAX_TOKENS=2048 TOTAL_TOKENS=2048
  WARMUP=60 LOG_INTERVAL=10)
nmtdeep_run() {  # BACKBONE SEED [LAYERS [LR]]: one training of NMTDEEP_UPDATES updates and its test score
  local layers="${3:-$NMTDEEP_LAYERS}" lr="${4:-$NMTDEEP_LR}"
  local name="nmtdeep_$1_L${layers}_lr${lr}_u${NMTDEEP_UPDATES}_s$2"
  [ -s "$RUNS/$name/bleu_test.txt" ] && { echo "$name scored before"; return 0; }
  run "$name" nmt/train_dense.sh BACKBONE="$1" LAYERS="$layers" LR="$lr" SEED="$2" "${NMTDEEP_ARGS[@]}" \
    MAX_UPDATE="$NMTDEEP_UPDATES" EXTRA_ARGS="--validate-interval-updates $NMTDEEP_VALID_EVERY"
  nmt_eval "$name"
}
nmtdeep() {
  local b s
  for s in "${SEEDS[@]}"; do for b in postln deepnorm magneto; do sched nmtdeep_run "$b" "$s"; done; done
  wait
  nmtdeep_plots
}
# The Post-LN 6-6 control of section 12 (the 18-18 runs' settings at 6 layers, seeds 1-3): its table and runs.
nmtdeep_control() {
  local s
  for s in "${SEEDS[@]}"; do sched nmtdeep_run postln "$s" 6; done
  wait
  nmtdeep_control_table
}
nmtdeep_control_table() {
  local out="$RESULTS/nmtdeep/control_L6"
  mkdir -p "$out"
  python experiments/aggregate.py "$RUNS"/nmtdeep_postln_L6_lr"${NMTDEEP_LR}"_u"$NMTDEEP_UPDATES"_s[0-9]*/ \
    --runs-jsonl "$out/runs.jsonl" | tee "$out/table.md"
}
# The same runs at the longest budget a 45-minute stage holds for one backbone's three seeds (two rounds of
# ~20 min on two idle cores): 1,500 updates (2.7 epochs), validation every 300 updates (600 is the short
# runs' end: the same seed's first 600 updates are the same run). One stage per backbone:
#   bash experiments/run.sh nmtlong postln|deepnorm|magneto
nmtlong() {  # BACKBONE
  local s NMTDEEP_UPDATES=1500 NMTDEEP_VALID_EVERY=300
  case "${1:-}" in
    postln | deepnorm | magneto) ;;
    *) echo "nmtlong: BACKBONE is postln, deepnorm or magneto (got '${1:-}'): bash $0 nmtlong deepnorm" >&2; return 2 ;;
  esac
  for s in "${SEEDS[@]}"; do sched nmtdeep_run "$1" "$s"; done
  wait
  nmtdeep_plots
}
# Do the translation models read their source? (section 12's diagnostic, experiments/source_use.py.) Every
# nmtdeep run (18-18 at 600 and 1,500 updates, 6-6 Post-LN): validation ppl with the real and with the
# shuffled sources (random.Random(0)), and the encoder output's spread over tokens, trained and at init.
source_use() {
  python experiments/source_use.py "$RUNS"/nmtdeep_*_lr"${NMTDEEP_LR}"_u{600,1500}_s[0-9]*/ --data "$NMT_DATA" \
    --init | tee "$RESULTS/nmtdeep/source_use.md"
}
# When does the encoder collapse? Seed 1 of each backbone again (the nmtdeep runs' first updates: the schedule
# does not depend on the budget), no validation (it does not change the training): 600 updates with a
# checkpoint every 50, and 50 updates with one every 5; the spread (also at init) and the shuffled-source
# ppl of each checkpoint on the first 300 validation verses, and the spread against the update.
source_use_timing() {
  local b budget name out="$RESULTS/nmtdeep"
  for b in deepnorm postln magneto; do
    for budget in 600:50 50:5; do
      name="nmtcollapse_${b}_L${NMTDEEP_LAYERS}_lr${NMTDEEP_LR}_u${budget%:*}_s1"
      grep -qs "done training" "$RUNS/$name/train.log" && continue  # (fairseq-train would resume it: one update more)
      sched run "$name" nmt/train_dense.sh BACKBONE="$b" \
        LAYERS="$NMTDEEP_LAYERS" LR="$NMTDEEP_LR" SEED=1 "${NMTDEEP_ARGS[@]}" MAX_UPDATE="${budget%:*}" \
        EXTRA_ARGS="--save-interval-updates ${budget#*:} --disable-validation"
    done
  done
  wait
  python experiments/source_use.py "$RUNS"/nmtcollapse_*_s1/checkpoint_[0-9]*_[0-9]*.pt --data "$NMT_DATA" \
    --max-verses 300 --init --plot "$out/encoder_spread.png" | tee "$out/source_use_timing.md"
}
# Section 12 in DeepNet's own warm-up regime (issue 45 item 4): the nmtdeep runs (18-18, d=64, the same data, batch,
# label smoothing, clipping at 1.0, no dropout, seeds 1-3, Post-LN, DeepNorm, Magneto) with the paper's peak rate,
# 5e-4 (DeepNet / TorchScale Table 3), reached after a warm-up that is most of the run: NMTWARM_WARMUP = 300 of
# NMTWARM_UPDATES = 400 updates (75%; the paper's 4,000-6,000 updates do not fit a stage). The rate climbs 20x
# more slowly than in the nmtdeep runs (1.7e-6 per update against 3.3e-5) and stays below the 1e-3 those runs
# passed at update 30, when DeepNorm's encoder had collapsed. No validation during training: a checkpoint every
# NMTWARM_SAVE_EVERY updates, measured after training by source_use.py (encoder spread, at init too, and the
# shuffled-source ppl; the first 300 validation verses), the last one on the whole validation split (the
# stall criterion: >= 415.6, 10% below the target unigram's 461.8). Run with JOBS=9: the nine runs train side by
# side, so that a stage cut short leaves every run near the same update (the schedule does not depend on the
# budget, so a run's first N updates are those of a run of N).
NMTWARM_LR="${NMTWARM_LR:-5e-4}"
NMTWARM_WARMUP="${NMTWARM_WARMUP:-300}"
NMTWARM_UPDATES="${NMTWARM_UPDATES:-400}"
NMTWARM_SAVE_EVERY="${NMTWARM_SAVE_EVERY:-50}"
NMTWARM_BACKBONES=(deepnorm postln magneto)
nmtwarm_name() {  # BACKBONE SEED
  echo "nmtwarm_$1_L${NMTDEEP_LAYERS}_lr${NMTWARM_LR}_w${NMTWARM_WARMUP}_u${NMTWARM_UPDATES}_s$2"
}
nmtwarm_run() {  # BACKBONE SEED: one training (a finished one is not run again: fairseq-train would add an update)
  local name
  name="$(nmtwarm_name "$1" "$2")"
  grep -qs "done training" "$RUNS/$name/train.log" && { echo "$name trained before"; return 0; }
  run "$name" nmt/train_dense.sh BACKBONE="$1" LAYERS="$NMTDEEP_LAYERS" LR="$NMTWARM_LR" SEED="$2" \
    "${NMTDEEP_ARGS[@]}" WARMUP="$NMTWARM_WARMUP" MAX_UPDATE="$NMTWARM_UPDATES" \
    EXTRA_ARGS="--save-interval-updates $NMTWARM_SAVE_EVERY --disable-validation"
}
nmtwarm() {
  local b s
  for s in "${SEEDS[@]}"; do for b in "${NMTWARM_BACKBONES[@]}"; do sched nmtwarm_run "$b" "$s"; done; done
  wait
  nmtwarm_report
}
# The report measures each run's checkpoints up to update NMTWARM_MEASURE_UPTO (default: the budget; lower when a
# stage is cut short: every run then reports the same updates).
NMTWARM_MEASURE_UPTO="${NMTWARM_MEASURE_UPTO:-$NMTWARM_UPDATES}"
nmtwarm_measure() {  # NAME: into the run's source_use.jsonl, source_use.py rows of its checkpoints up to update
  # NMTWARM_MEASURE_UPTO on the first 300 validation verses (with the spread at init), and of the one at that update
  # on the whole validation split
  local dir="$RUNS/$1" last="$RUNS/$1/checkpoint_1_$NMTWARM_MEASURE_UPTO.pt" ckpts=() c u
  rm -f "$dir/source_use.jsonl"
  [ -f "$last" ] || { echo "$1: no checkpoint at update $NMTWARM_MEASURE_UPTO ($last); not measured"; return 1; }
  for c in "$dir"/checkpoint_1_[0-9]*.pt; do
    u="${c##*_}"
    [ "${u%.pt}" -le "$NMTWARM_MEASURE_UPTO" ] && ckpts+=("$c")
  done
  python experiments/source_use.py "${ckpts[@]}" --data "$NMT_DATA" --max-verses 300 --init \
    --records "$dir/source_use.jsonl" > "$RUNS/$1.source_use.out" 2>&1 &&
    python experiments/source_use.py "$last" --data "$NMT_DATA" --records "$dir/source_use.jsonl" \
      >> "$RUNS/$1.source_use.out" 2>&1
  echo "$1 measured to update $NMTWARM_MEASURE_UPTO: exit $? $(date -u +%H:%M:%S)"
}
nmtwarm_report() {  # the runs' rows in docs/results/nmtdeep/warmup/runs.jsonl, the table and plot computed from it
  local out="$RESULTS/nmtdeep/warmup" b s names=()
  mkdir -p "$out"
  for s in "${SEEDS[@]}"; do for b in "${NMTWARM_BACKBONES[@]}"; do names+=("$(nmtwarm_name "$b" "$s")"); done; done
  for s in "${names[@]}"; do sched nmtwarm_measure "$s"; done
  wait
  for s in "${names[@]}"; do cat "$RUNS/$s/source_use.jsonl" 2>/dev/null; done > "$out/runs.jsonl"
  python experiments/source_use_summary.py "$out/runs.jsonl" --unigram 461.8 --plot "$out/encoder_spread.png" \
    | tee "$out/table.md"
}
nmtdeep_plots() {  # the 3-seed table and curves of docs/results.md section 12 at NMTDEEP_UPDATES (agg_plots)
  local out="$RESULTS/nmtdeep/u$NMTDEEP_UPDATES"
  mkdir -p "$out"
  AGG_METRICS="valid_ppl train_loss gnorm" agg_plots "$out" \
    "$RUNS"/nmtdeep_*_L"${NMTDEEP_LAYERS}"_lr"${NMTDEEP_LR}"_u"$NMTDEEP_UPDATES"_s[0-9]*/ | tee "$out/table.md"
}

# Routing options (issue 26): four ways to route at the same active FLOPs per token and the same
# routed expert parameters, in the width stage's LM (4-layer Magneto d=128, FFN 512, MoE in layers 2
# and 4, same data, batch, lr, clipping and validation): E=8 experts of width F=256 (half the dense
# FFN), top-2 with both experts kept (--moe-second-expert-policy all: exactly 2F active per token;
# the recipe's default `random` drops the second expert at random), capacity factor 1.25:
#   xmoe     X-MoE router, balance loss 0.01 (the recipe's default router and loss);
#   zloss    xmoe + router z-loss 1e-3 (ST-MoE);
#   auxfree  DeepSeek-V3 auxiliary-loss-free balancing: bias rate ROUTING_BIAS_RATE, balance loss 0;
#   fine     fine-grained + shared: 32 experts of width 64, top-7, plus 1 shared expert of width 64
#            (8 x 64 = 2 x 256 active; 32 x 64 = 8 x 256 routed), X-MoE router, balance loss 0.01.
# ROUTING_BIAS_RATE was chosen on validation (seed 4, not one of the reported seeds): see docs/results.md.
ROUTING_BIAS_RATE="${ROUTING_BIAS_RATE:-1e-3}"
ROUTING_UPDATES="${ROUTING_UPDATES:-200}"
ROUTING_ARGS=(DATA="$SPM_LM_DATA" BACKBONE=magneto LAYERS=4 EMBED_DIM=128 FFN_DIM=512 HEADS=4
  TOKENS_PER_SAMPLE=128 TOTAL_BATCH=16 BATCH_SIZE=16 LR=3e-3 WARMUP=20 MAX_UPDATE="$ROUTING_UPDATES"
  LOG_INTERVAL=10 CLIP_NORM=1.0 MOE_FREQ=2 CLIP=sparse)
routing_run() {  # CONFIG (xmoe|zloss|auxfree|fine) SEED
  local base="--validate-interval-updates 50 --moe-second-expert-policy all"
  case "$1" in
    xmoe) run "routing_$1_s$2" lm/train_moe.sh "${ROUTING_ARGS[@]}" SEED="$2" EXPERTS=8 TOP_K=2 \
      EXTRA_ARGS="$base --moe-expert-ffn-dim 256" ;;
    zloss) run "routing_$1_s$2" lm/train_moe.sh "${ROUTING_ARGS[@]}" SEED="$2" EXPERTS=8 TOP_K=2 \
      EXTRA_ARGS="$base --moe-expert-ffn-dim 256 --moe-z-loss-wt 1e-3" ;;
    auxfree) run "routing_$1_s$2" lm/train_moe.sh "${ROUTING_ARGS[@]}" SEED="$2" EXPERTS=8 TOP_K=2 BALANCE=0 \
      EXTRA_ARGS="$base --moe-expert-ffn-dim 256 --moe-router-bias-update-rate $ROUTING_BIAS_RATE" ;;
    fine) run "routing_$1_s$2" lm/train_moe.sh "${ROUTING_ARGS[@]}" SEED="$2" EXPERTS=32 TOP_K=7 \
      EXTRA_ARGS="$base --moe-expert-ffn-dim 64 --moe-shared-expert-count 1" ;;
    *) echo "routing_run: unknown config $1 (xmoe|zloss|auxfree|fine)" >&2; return 2 ;;
  esac
}
# The first 20 updates of routing_xmoe_s1 again (same trajectory), logged every update and checkpointed
# every 4, and which of router and tokens moves the routing (experiments/early_routing.py;
# reads routing_xmoe_s1 too: run after `routing`).
routing_early() {
  local args=("${ROUTING_ARGS[@]}" SEED=1 EXPERTS=8 TOP_K=2 LOG_INTERVAL=1)
  local extra="--moe-second-expert-policy all --moe-expert-ffn-dim 256 --disable-validation --no-save-optimizer-state"
  run routing_early_u1 lm/train_moe.sh "${args[@]}" EXTRA_ARGS="$extra --max-update 1"
  run routing_early_u20 lm/train_moe.sh "${args[@]}" EXTRA_ARGS="$extra --max-update 20 --save-interval-updates 4"
  python experiments/early_routing.py "$RUNS" | tee "$RESULTS/routing/early_routing.txt"
}
routing() {
  local c s
  for s in "${SEEDS[@]}"; do for c in xmoe zloss auxfree fine; do sched routing_run "$c" "$s"; done; done
  wait
  routing_plots
}

# Mean curves with a min-max band over the seeds (experiments/aggregate.py), and the tables of
# docs/results.md sections 2-3, with the runs behind them (runs.jsonl: aggregate.py --runs-jsonl).
agg_plots() {  # OUT_DIR RUN_DIR... : one PNG per metric of $AGG_METRICS
  local out="$1" m
  shift
  python experiments/aggregate.py "$@" --runs-jsonl "$out/runs.jsonl"
  for m in $AGG_METRICS; do python experiments/aggregate.py "$@" --plot "$out/$m.png" --metric "$m" >/dev/null; done
}
width_plots() {
  AGG_METRICS="valid_ppl train_loss routing_entropy clipping" \
    agg_plots "$RESULTS/width" "$RUNS"/width_{dense,moe8,moe32}_s*/
}
routing_plots() {  # table.md with the MoE columns (load CV, dropped fraction) and the curves
  local out="$RESULTS/routing" m
  mkdir -p "$out"
  python experiments/aggregate.py --moe --runs-jsonl "$out/runs.jsonl" "$RUNS"/routing_{xmoe,zloss,auxfree,fine}_s*/ | tee "$out/table.md"
  for m in valid_ppl moe_gate_loss moe_cv routing_entropy; do
    python experiments/aggregate.py "$RUNS"/routing_{xmoe,zloss,auxfree,fine}_s*/ --plot "$out/$m.png" \
      --metric "$m" --title "routing options, $m, 3 seeds (mean, min-max band)" >/dev/null
  done
}
nmt_plots() {  # section 4's runs.jsonl and curves
  local runs=("$RUNS"/nmt_{dense,moe16}_s[0-9]*/) metric
  mkdir -p "$RESULTS/nmt"
  python experiments/aggregate.py --moe "${runs[@]}" --runs-jsonl "$RESULTS/nmt/runs.jsonl"
  for metric in valid_ppl routing_entropy; do
    python experiments/aggregate.py "${runs[@]}" --metric "$metric" \
      --plot "$RESULTS/nmt/$metric.png" --title "NMT: dense vs X-MoE top-1 (paper Fig. 2b), $metric" > /dev/null
  done
}
clip_plots() {
  AGG_METRICS="valid_ppl train_loss routing_entropy clipping gnorm gnorm_dense gnorm_expert" \
    agg_plots "$RESULTS/clip" "$RUNS"/clip_{sparse,vanilla}_s*/
}

# The PNGs of docs/results.md (ts-plot-logs, one directory per experiment).
plots() {
  depth_plots
  stability_report
  deeper_plots
  width_plots
  clip_plots
  clipscale_plots
  clipedge_plots
  nmtdeep_plots
  NMTDEEP_UPDATES=1500 nmtdeep_plots
  nmtdeep_control_table
  routing_plots
  nmt_plots
}

case "${1:-all}" in
  prep)
    python -m data_prep.prepare_lm --out-dir "$SPM_LM_DATA" --spm-vocab 4000
    python -m data_prep.prepare_nmt --out-dir "$NMT_DATA" --vocab-size 4000 --force ;;
  depth) depth ;;
  depth_run) depth_run "$2" "$3" "${4:-1}"; wait ;;
  depth_plots) depth_plots ;;
  stability) stability ;;
  deeper) deeper ;;
  deeper_plots) deeper_plots ;;
  stability_report) stability_report ;;
  stability_search) stability_search ;;
  width) width ;;
  width_run) width_run "$2" "$3" ;;
  clip) clip ;;
  clip_run) clip_run "$2" "$3" ;;
  nmt) nmt ;;
  nmt_run) nmt_run "$2" "$3" ;;
  nmt_plots) nmt_plots ;;
  nmtdeep) nmtdeep ;;
  nmtdeep_control) nmtdeep_control ;;
  nmtdeep_control_table) nmtdeep_control_table ;;
  nmtdeep_run) nmtdeep_run "$2" "$3" "${4:-}" "${5:-}" ;;
  nmtlong) nmtlong "${2:-}" ;;
  nmtdeep_plots) nmtdeep_plots ;;
  nmtwarm) nmtwarm ;;
  nmtwarm_run) nmtwarm_run "$2" "$3"; wait ;;
  nmtwarm_measure) nmtwarm_measure "$2" ;;
  nmtwarm_report) nmtwarm_report ;;
  source_use) source_use ;;
  source_use_timing) source_use_timing ;;
  routing) routing ;;
  routing_run) routing_run "$2" "$3" ;;
  routing_plots) routing_plots ;;
  routing_early) routing_early ;;
  width_plots) width_plots ;;
  clip_plots) clip_plots ;;
  clipscale) clipscale ;;
  clipedge) clipedge ;;
  clipedge_run) clipedge_run "$2" "$3" ;;
  clipedge_plots) clipedge_plots ;;
  clipscale_plots) clipscale_plots ;;
  plots) plots ;;
  all) depth; stability; deeper; width; clip; clipscale; clipedge; nmt; nmtdeep; nmtdeep_control; nmtlong postln; nmtlong deepnorm; nmtlong magneto; source_use; source_use_timing; nmtwarm; routing; plots ;;
  *) echo "usage: $0 prep|depth|depth_run BACKBONE LAYERS [SEED]|depth_plots|stability|stability_report|stability_search|deeper|deeper_plots|width|width_run CONFIG SEED|width_plots|clip|clip_run CONFIG SEED|clip_plots|clipscale|clipscale_plots|clipedge|clipedge_run CONFIG SEED|clipedge_plots|nmt|nmt_run CONFIG SEED|nmt_plots|nmtdeep|nmtdeep_run BACKBONE SEED [LAYERS [LR]]|nmtdeep_control|nmtdeep_control_table|nmtlong BACKBONE|nmtdeep_plots|nmtwarm|nmtwarm_run BACKBONE SEED|nmtwarm_measure RUN_NAME|nmtwarm_report|source_use|source_use_timing|routing|routing_run CONFIG SEED|routing_plots|routing_early|plots|all" >&2; exit 2 ;;
esac
