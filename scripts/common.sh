# Shared code of scripts/lm/*.sh and scripts/nmt/*.sh (sourced, not run).
#
# Conventions: every setting is an environment variable; `ts_default NAME FULL TINY` gives NAME
# the paper value, or the tiny value when SCALE=tiny (minutes on a CPU), unless NAME is set.
# EXTRA_ARGS is appended (word-split) to the fairseq command.
#
# Launch: NNODES x NPROC_PER_NODE processes through torchrun (NODE_RANK, MASTER_ADDR, MASTER_PORT)
# when more than one; on one node without MASTER_PORT, `torchrun --standalone` (its agent binds a
# port the OS assigns and keeps it: concurrent jobs never collide); across nodes MASTER_PORT
# defaults to 29500; SLURM=1 runs fairseq-train directly and lets fairseq read the Slurm
# environment (start the script with srun, one task per GPU). MP = tensor-parallel size, PP = pipeline
# stages, CP = context-parallel size (LM recipes, training only; NPROC_PER_NODE defaults to MP x PP x CP;
# the rank is t + MP (c + CP (d + DP p))); at MP > 1 fairseq writes one checkpoint part per
# tensor-parallel rank (NAME-model_part-K.pt, and NAME-model_part-K-shardR.pt when experts are spread over
# data-parallel ranks), at PP > 1 one file per stage (NAME[-model_part-K]-stageP.pt); evaluation runs at
# the same MP on one stage (expert shards consolidated, stages merged first). ZERO = --zero-sharding:
# none, os (optimizer state over the data-parallel ranks) or full (FSDP2: parameters, gradients and
# optimizer state; LM recipes, bf16 or fp32, with MP and --sequence-parallel, not with PP or experts);
# every ZERO writes the same checkpoint format, so evaluation and resumes need no conversion.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
BIN="$VENV/bin"
PY="$BIN/python"
USER_DIR="$ROOT/torchscale_fairseq"
SCALE="${SCALE:-full}"
TS_NAME="${TS_NAME:-$(basename "$(dirname "$0")")/$(basename "$0" .sh)}"

say() { echo "[$TS_NAME] $*"; }
die() { echo "[$TS_NAME] error: $*" >&2; exit 1; }

case "$SCALE" in full | tiny) ;; *) die "SCALE=$SCALE: choose full or tiny" ;; esac
[ -x "$PY" ] || die "$PY not found; fix: bash scripts/install.sh"

# ts_default NAME FULL TINY: set NAME unless already set in the environment.
ts_default() {
  local name="$1" full="$2" tiny="$3"
  if [ -z "${!name+x}" ]; then
    if [ "$SCALE" = tiny ]; then printf -v "$name" '%s' "$tiny"; else printf -v "$name" '%s' "$full"; fi
  fi
}

# Integer check with a one-line error.
ts_int() {
  local name="$1"
  [[ "${!name}" =~ ^[0-9]+$ ]] || die "$name=${!name} is not a non-negative integer"
}

MP="${MP:-1}"
PP="${PP:-1}"
CP="${CP:-1}"
ts_int MP
ts_int PP
ts_int CP
[ "$MP" -ge 1 ] || die "MP=$MP: the tensor-parallel size is at least 1"
[ "$PP" -ge 1 ] || die "PP=$PP: the pipeline size is at least 1"
[ "$CP" -ge 1 ] || die "CP=$CP: the context-parallel size is at least 1"
NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$((MP * PP * CP))}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-}"
SLURM="${SLURM:-0}"
for v in NNODES NPROC_PER_NODE NODE_RANK; do ts_int "$v"; done
[ -z "$MASTER_PORT" ] || ts_int MASTER_PORT
WORLD=$((NNODES * NPROC_PER_NODE))
[ "$WORLD" -ge 1 ] || die "NNODES x NPROC_PER_NODE must be at least 1"
[ $((WORLD % MP)) = 0 ] || die "MP=$MP does not divide the $WORLD processes (NNODES x NPROC_PER_NODE)"
[ $((WORLD % (MP * PP))) = 0 ] || die "MP x PP = $((MP * PP)) does not divide the $WORLD processes (NNODES x NPROC_PER_NODE)"
ZERO="${ZERO:-none}"
case "$ZERO" in none | os | full) ;; *) die "ZERO=$ZERO: choose none, os or full" ;; esac
if [ "$ZERO" = full ]; then
  [ "$PP" = 1 ] || die "ZERO=full with PP=$PP: fully sharded layers do not follow the pipeline schedule; use ZERO=os (or PP=1)"
  [ $((WORLD / (MP * PP))) -ge 2 ] \
    || die "ZERO=full shards over data-parallel ranks and this run has one: NPROC_PER_NODE (or NNODES) above MP=$MP, or ZERO=none"
fi
ZERO_ARGS=()  # training only
[ "$ZERO" = none ] || ZERO_ARGS=(--zero-sharding "$ZERO")
[ $((WORLD % (MP * PP * CP))) = 0 ] \
  || die "MP x PP x CP = $((MP * PP * CP)) does not divide the $WORLD processes (NNODES x NPROC_PER_NODE)"

# Device: DEVICE=cpu|cuda; default cuda when torch sees a GPU (always cpu at SCALE=tiny).
if [ -z "${DEVICE:-}" ]; then
  if [ "$SCALE" = tiny ]; then DEVICE=cpu
  elif "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then DEVICE=cuda
  else DEVICE=cpu
  fi
fi
PRECISION="${PRECISION:-$([ "$ZERO" = full ] && echo bf16 || echo fp16)}"  # on cuda: fp16, bf16 or fp32
[ "$ZERO" != full ] || [ "$PRECISION" != fp16 ] \
  || die "ZERO=full keeps fp32 shards and computes in bf16: PRECISION=bf16 (or fp32), or ZERO=os for fp16"
case "$DEVICE" in
  cpu) DEVICE_ARGS=(--cpu --distributed-backend gloo) ;;
  cuda) DEVICE_ARGS=(); [ "$PRECISION" = fp32 ] || DEVICE_ARGS=(--"$PRECISION") ;;
  *) die "DEVICE=$DEVICE: choose cpu or cuda" ;;
esac
DDP_ARGS=(--ddp-backend legacy_ddp)
[ "$ZERO" != full ] || DDP_ARGS=()  # FSDP2 takes DDP's place
[ "$MP" -le 1 ] || DEVICE_ARGS+=(--model-parallel-size "$MP" "${DDP_ARGS[@]}")
PIPELINE_ARGS=()  # pipeline and context parallelism: training only (evaluation runs one stage at CP = 1)
[ "$PP" -le 1 ] || PIPELINE_ARGS=(--pipeline-model-parallel-size "$PP" --ddp-backend legacy_ddp)
[ "$CP" -le 1 ] || PIPELINE_ARGS+=(--context-parallel-size "$CP")

# ceil(a / b)
ts_ceil_div() { echo $((($1 + $2 - 1) / $2)); }

# Data-parallel ranks (the tensor-parallel ranks, pipeline stages and context-parallel ranks of one model
# share its batches).
DP_WORLD=$((WORLD / (MP * PP * CP)))

# ts_launch TOOL ARGS...: run a fairseq console tool on one process, through torchrun, or under Slurm.
ts_launch() {
  local tool="$BIN/$1"
  shift
  [ -x "$tool" ] || die "$tool not found; fix: bash scripts/install.sh"
  if [ "$SLURM" = 1 ]; then
    "$tool" "$@" --distributed-port "${MASTER_PORT:-29500}"
  elif [ "$WORLD" -gt 1 ] && [ "$NNODES" = 1 ] && [ -z "$MASTER_PORT" ]; then
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC_PER_NODE" \
      "$tool" "$@" --distributed-world-size "$WORLD"
  elif [ "$WORLD" -gt 1 ]; then
    "$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
      --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
      "$tool" "$@" --distributed-world-size "$WORLD"
  else
    "$tool" "$@"
  fi
}

# ts_train SAVE_DIR ARGS...: fairseq-train with JSON logs, shown and appended to SAVE_DIR/train.log.
# --required-batch-size-multiple 1: batches of any size, so tiny validation sets are never
# rounded away (torchscale_fairseq/compat/batching.py also keeps fairseq-fixed's trailing batch).
ts_train() {
  local save="$1"
  shift
  mkdir -p "$save"
  say "training; log: $save/train.log"
  # shellcheck disable=SC2086  # EXTRA_ARGS is split into words on purpose
  ts_launch fairseq-train "$@" --save-dir "$save" --log-format json --log-interval "$LOG_INTERVAL" \
    --no-epoch-checkpoints --required-batch-size-multiple 1 "${DEVICE_ARGS[@]}" "${PIPELINE_ARGS[@]}" \
    "${ZERO_ARGS[@]}" ${EXTRA_ARGS:-} 2>&1 \
    | tee -a "$save/train.log"
  ts_checkpoint_files "$save" checkpoint_last >/dev/null \
    || die "training wrote no checkpoint in $save; see $save/train.log"
}

# ts_checkpoint_files SAVE_DIR NAME: the files of checkpoint NAME in every layout fairseq and the
# plugin write (NAME.pt; NAME-shardR.pt; NAME-stageP[-shardR].pt; NAME-model_part-K[-stageP][-shardR].pt), one
# a line; fails when there are none.
ts_checkpoint_files() {
  local save="$1" name="$2"
  compgen -G "$save/$name.pt" || compgen -G "$save/$name-shard[0-9]*.pt" \
    || compgen -G "$save/$name-stage[0-9]*.pt" || compgen -G "$save/$name-model_part-[0-9]*.pt"
}

# ts_clip_args: optimizer flags for CLIP=sparse (SparseClip around Adam) or CLIP=vanilla (Adam).
ts_clip_args() {
  case "$CLIP" in
    sparse) OPT_ARGS=(--optimizer sparse_clip --sparse-clip-base adam) ;;
    vanilla) OPT_ARGS=(--optimizer adam) ;;
    *) die "CLIP=$CLIP: choose sparse or vanilla" ;;
  esac
  OPT_ARGS+=(--adam-betas "(0.9,0.98)" --clip-norm "$CLIP_NORM")
}

# ts_checkpoint SAVE_DIR NAME: the --path to evaluate checkpoint NAME at this MP: NAME.pt itself, its
# tensor-parallel parts (fairseq opens NAME-model_part-K.pt on rank K), or its expert shards
# consolidated into NAME.consolidated.pt (at MP > 1 into NAME.consolidated-model_part-K.pt).
ts_checkpoint() {
  local save="$1" name="$2" parts=1 input
  ts_checkpoint_files "$save" "$name" >/dev/null || die "no checkpoint $save/$name.pt; train first"
  if compgen -G "$save/$name-stage[0-9]*.pt" >/dev/null \
      || compgen -G "$save/$name-model_part-[0-9]*-stage[0-9]*.pt" >/dev/null; then
    input="$save/$name.pt"  # pipeline stages: experts consolidated, stages merged into one stack at this MP
    if compgen -G "$save/$name-*stage[0-9]*-shard[0-9]*.pt" >/dev/null; then
      "$PY" -m torchscale_fairseq.cli.consolidate_experts "$input" -o "$save/$name.consolidated.pt" >&2 \
        || die "could not consolidate the expert shards $save/$name*-shard*.pt"
      input="$save/$name.consolidated.pt"
    fi
    "$PY" -m torchscale_fairseq.cli.reshard --input "$input" --pipeline-size 1 --size "$MP" \
      --output "$save/$name.one_stage.pt" >/dev/null || die "could not merge the pipeline stages $save/$name*-stage*.pt"
    echo "$save/$name.one_stage.pt"
    return
  fi
  if compgen -G "$save/$name-model_part-[0-9]*.pt" >/dev/null; then
    parts="$(compgen -G "$save/$name-model_part-[0-9]*.pt" | sed 's/.*-model_part-\([0-9]*\).*/\1/' | sort -u | wc -l)"
  fi
  [ "$parts" = "$MP" ] || die "$save/$name was saved at MP=$parts: evaluate it with MP=$parts (or reshard with ts-reshard)"
  if [ -f "$save/$name.pt" ] || [ -f "$save/$name-model_part-0.pt" ]; then
    echo "$save/$name.pt"
  else
    "$PY" -m torchscale_fairseq.cli.consolidate_experts "$save/$name.pt" -o "$save/$name.consolidated.pt" >&2 \
      || die "could not consolidate the expert shards $save/$name*-shard*.pt"
    echo "$save/$name.consolidated.pt"
  fi
}

# ts_need_data DIR FILE...: one-line error unless the prepared data is there.
ts_need_data() {
  local dir="$1" f
  shift
  for f in "$@"; do
    [ -f "$dir/$f" ] || die "$dir/$f not found; prepare the data first (see the script's header)"
  done
}

# ts_lm_setup: the LM recipe (TorchScale paper Tables 1-2) into MODEL_ARGS / TRAIN_ARGS.
ts_lm_setup() {
  ts_default DATA data-bin/enwiki_gpt2 data-bin/enwiki_gpt2_tiny
  ts_default ARCH ts_lm_large ts_lm_tiny
  ts_default LAYERS 12 2
  ts_default EMBED_DIM 1024 64
  ts_default FFN_DIM 4096 128
  ts_default HEADS 16 2
  ts_default BACKBONE magneto magneto
  ts_default LR 5e-4 2e-3
  ts_default WARMUP 750 5
  ts_default MAX_UPDATE 50000 30
  ts_default DROPOUT 0.1 0.1
  ts_default ATTENTION_DROPOUT 0.1 0.0
  ts_default WEIGHT_DECAY 0.01 0.01
  ts_default TOKENS_PER_SAMPLE 128 64
  ts_default TOTAL_BATCH 2048 8      # samples per update, over all data-parallel ranks
  ts_default BATCH_SIZE 16 8         # samples per rank and forward pass
  ts_default LOG_INTERVAL 100 5
  ts_default SEED 1 1
  for v in LAYERS MAX_UPDATE WARMUP TOTAL_BATCH BATCH_SIZE TOKENS_PER_SAMPLE; do ts_int "$v"; done
  ts_need_data "$DATA" dict.txt train.bin valid.bin
  if [ -z "${UPDATE_FREQ:-}" ]; then
    UPDATE_FREQ="$(ts_ceil_div "$TOTAL_BATCH" $((BATCH_SIZE * DP_WORLD)))"
    if [ "$UPDATE_FREQ" -lt "$PP" ]; then  # a pipeline needs PP micro-batches or more: smaller ones, same total
      UPDATE_FREQ="$PP"
      BATCH_SIZE="$(ts_ceil_div "$TOTAL_BATCH" $((PP * DP_WORLD)))"
    fi
  fi
  MODEL_ARGS=(--arch "$ARCH" --backbone "$BACKBONE" --decoder-layers "$LAYERS" --decoder-embed-dim "$EMBED_DIM"
    --decoder-ffn-embed-dim "$FFN_DIM" --decoder-attention-heads "$HEADS" --dropout "$DROPOUT"
    --attention-dropout "$ATTENTION_DROPOUT" --share-decoder-input-output-embed)
  TRAIN_ARGS=("$DATA" --user-dir "$USER_DIR" --task language_modeling --tokens-per-sample "$TOKENS_PER_SAMPLE"
    --sample-break-mode none --lr "$LR" --lr-scheduler polynomial_decay --warmup-updates "$WARMUP"
    --total-num-update "$MAX_UPDATE" --weight-decay "$WEIGHT_DECAY" --batch-size "$BATCH_SIZE"
    --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE" --seed "$SEED" --num-workers 0)
  say "LM $ARCH $BACKBONE: $LAYERS layers, d=$EMBED_DIM, ffn=$FFN_DIM, $HEADS heads; ${BATCH_SIZE}x${DP_WORLD} ranks x update-freq $UPDATE_FREQ samples of $TOKENS_PER_SAMPLE tokens; $MAX_UPDATE updates; data $DATA"
}

# ts_nmt_setup: the NMT recipe (TorchScale paper Tables 3-4) into MODEL_ARGS / TRAIN_ARGS.
ts_nmt_setup() {
  [ "$PP" = 1 ] || die "PP=$PP: pipeline parallelism runs the LM recipes (ts_lm) only; use PP=1 (MP for tensor parallelism)"
  [ "$ZERO" != full ] || die "ZERO=full runs the LM recipes (ts_lm) only; use ZERO=os for NMT"
  [ "$CP" = 1 ] || die "CP=$CP: context parallelism runs the LM recipes (ts_lm) only; use CP=1 (MP for tensor parallelism)"
  ts_default DATA data-bin/kjv_sparv_spm data-bin/kjv_sparv_spm_tiny
  ts_default SRC_LANG en en
  ts_default TGT_LANG es es
  ts_default ARCH ts_transformer_large ts_transformer_tiny
  ts_default LAYERS 12 2             # encoder and decoder layers each (ENC_LAYERS/DEC_LAYERS override)
  ENC_LAYERS="${ENC_LAYERS:-$LAYERS}"
  DEC_LAYERS="${DEC_LAYERS:-$LAYERS}"
  ts_default EMBED_DIM 1024 64
  ts_default FFN_DIM 4096 128
  ts_default HEADS 16 2
  ts_default BACKBONE magneto magneto
  ts_default LR 5e-4 2e-3
  ts_default WARMUP 6000 5
  ts_default MAX_UPDATE 100000 30
  ts_default DROPOUT 0.1 0.1
  ts_default WEIGHT_DECAY 0.0 0.0
  ts_default LABEL_SMOOTHING 0.1 0.1
  ts_default CLIP_NORM 1.0 1.0
  ts_default TOTAL_TOKENS 262144 1024  # tokens per update, over all data-parallel ranks
  ts_default MAX_TOKENS 4096 1024      # tokens per rank and forward pass
  ts_default LOG_INTERVAL 100 5
  ts_default SEED 1 1
  for v in ENC_LAYERS DEC_LAYERS MAX_UPDATE WARMUP TOTAL_TOKENS MAX_TOKENS; do ts_int "$v"; done
  ts_need_data "$DATA" "dict.$SRC_LANG.txt" "dict.$TGT_LANG.txt" "train.$SRC_LANG-$TGT_LANG.$SRC_LANG.bin"
  UPDATE_FREQ="${UPDATE_FREQ:-$(ts_ceil_div "$TOTAL_TOKENS" $((MAX_TOKENS * DP_WORLD)))}"
  MODEL_ARGS=(--arch "$ARCH" --backbone "$BACKBONE" --encoder-layers "$ENC_LAYERS" --decoder-layers "$DEC_LAYERS"
    --encoder-embed-dim "$EMBED_DIM" --decoder-embed-dim "$EMBED_DIM" --encoder-ffn-embed-dim "$FFN_DIM"
    --decoder-ffn-embed-dim "$FFN_DIM" --encoder-attention-heads "$HEADS" --decoder-attention-heads "$HEADS"
    --dropout "$DROPOUT" --share-all-embeddings)
  TRAIN_ARGS=("$DATA" --user-dir "$USER_DIR" --task translation --source-lang "$SRC_LANG" --target-lang "$TGT_LANG"
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --weight-decay "$WEIGHT_DECAY"
    --label-smoothing "$LABEL_SMOOTHING" --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ"
    --max-update "$MAX_UPDATE" --seed "$SEED" --num-workers 0)
  say "NMT $ARCH $BACKBONE: $ENC_LAYERS-$DEC_LAYERS layers, d=$EMBED_DIM, ffn=$FFN_DIM, $HEADS heads; ${MAX_TOKENS}x${DP_WORLD} ranks x update-freq $UPDATE_FREQ tokens; $MAX_UPDATE updates; data $DATA"
}

# ts_moe_setup: X-MoE flags (EXPERTS, MOE_FREQ, TOP_K, BALANCE) and CLIP=sparse|vanilla into MOE_ARGS/OPT_ARGS.
ts_moe_setup() {
  [ "$ZERO" != full ] || die "ZERO=full with experts: each data-parallel rank holds its own; use ZERO=os"
  ts_default EXPERTS 16 4
  ts_default MOE_FREQ 2 2
  ts_default TOP_K 2 2
  ts_default BALANCE 0.01 0.01
  ts_default CLIP sparse sparse
  ts_default CLIP_NORM 1.0 1.0
  for v in EXPERTS MOE_FREQ TOP_K; do ts_int "$v"; done
  MOE_ARGS=(--moe-expert-count "$EXPERTS" --moe-freq "$MOE_FREQ" --moe-top-k "$TOP_K" --moe-gate-loss-wt "$BALANCE")
  ts_clip_args
  say "X-MoE: $EXPERTS experts, every $MOE_FREQ layers, top-$TOP_K, balance $BALANCE; clipping $CLIP at $CLIP_NORM"
}
