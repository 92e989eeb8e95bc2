#!/usr/bin/env bash
# First run for a new user (works from any directory; paths below are relative to the repo root):
#   1. install .venv (scripts/install.sh),
#   2. prepare the gensim Wikipedia excerpt with GPT-2 BPE into $DATA_DIR (skipped if already there),
#   3. train a small Magneto language model on CPU with fairseq's adaptive input and adaptive
#      softmax over the 50K GPT-2 vocabulary (bands cut at $ADAPTIVE_CUTOFF; empty: a full tied
#      softmax) (resumes from $SAVE_DIR/checkpoint_last.pt; skipped once $SAVE_DIR/train.log
#      reports $MAX_UPDATE updates),
#   4. report the validation perplexity (fairseq-eval-lm) beside the add-one-smoothed unigram
#      perplexity of the same training tokens (data_prep.unigram_ppl), and sample a continuation of $PROMPT,
#   5. prepare the English-Spanish Bible (KJV / Reina-Valera 1909, aligned by verse, joint
#      SentencePiece) into $NMT_DATA and train a small X-MoE translation model with SparseClip
#      (scripts/nmt/train_moe.sh at SCALE=tiny, resumable); with PARALLEL=1 (default) this runs
#      beside steps 2-4, one thread each, its output in $NMT_SAVE_DIR/demo.log; then report BLEU and
#      chrF on the held-out test set (scripts/nmt/evaluate.sh) beside those of copying the English
#      source (data_prep.nmt_baseline),
#   6. plot validation perplexity, routing entropy and clipped updates (ts-plot-logs) into $PLOT_DIR
#      and print a summary table, with the ts-export-hf command that exports the LM to transformers.
#      NMT=0 skips the translation part.
# Defaults (docs/results.md, section 5: timing, numbers and every configuration tried): 1200 LM updates
# of 8 x 128 tokens (lr 4e-3, linear decay, weight decay 0.3, no dropout) beside 1600 NMT updates of
# 2048 tokens (d=128, FFN 512, lr 5e-3, no dropout), beam 4: 10 min 24 s from a fresh clone on 2 idle
# CPU cores (install with a warm pip cache included), LM 3.17x below unigram perplexity, test BLEU 10.5.
# Every knob is an environment variable, e.g.  MAX_UPDATE=50 PROMPT="In 1905," bash scripts/demo.sh
set -euo pipefail
trap 'echo "[demo] error: the step at scripts/demo.sh line $LINENO failed; see the output above" >&2' ERR
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

export VENV="${VENV:-$ROOT/.venv}"
SKIP_INSTALL="${SKIP_INSTALL:-0}"          # 1: use $VENV as it is
DATA_DIR="${DATA_DIR:-data-bin/enwiki_gpt2}"
MAX_DOCS="${MAX_DOCS:-}"                   # empty: all articles of the excerpt
SAVE_DIR="${SAVE_DIR:-checkpoints/demo_lm}"
ARCH="${ARCH:-ts_lm_tiny}"
BACKBONE="${BACKBONE:-magneto}"
TOKENS_PER_SAMPLE="${TOKENS_PER_SAMPLE:-128}"
BATCH_SIZE="${BATCH_SIZE:-8}"               # 8 x 1200 updates: valid ppl 750 vs 813 for 16 x 600, same tokens and CPU time
LR="${LR:-4e-3}"                           # peak; linear decay to 0 at MAX_UPDATE (polynomial_decay)
WARMUP_UPDATES="${WARMUP_UPDATES:-40}"
MAX_UPDATE="${MAX_UPDATE:-1200}"
DROPOUT="${DROPOUT:-0.0}"                  # a few epochs at most: dropout only slows learning
WEIGHT_DECAY="${WEIGHT_DECAY:-0.3}"        # decoupled (AdamW); valid ppl 673 vs 744 without, by curbing memorisation in pass 3
ADAPTIVE_CUTOFF="${ADAPTIVE_CUTOFF:-2000,10000}"  # adaptive input/softmax bands (GPT-2 ids + 4); empty: full softmax
ADAPTIVE_FACTOR="${ADAPTIVE_FACTOR:-2}"    # band i has dimension d / factor**i (2: valid ppl 813 vs 919 for 4, same cost)
VALIDATE_INTERVAL="${VALIDATE_INTERVAL:-400}"  # validation every N updates (fairseq saves checkpoint_best at epoch ends and the last update)
LOG_INTERVAL="${LOG_INTERVAL:-20}"
SEED="${SEED:-1}"
EXTRA_TRAIN_ARGS="${EXTRA_TRAIN_ARGS:-}"   # appended to fairseq-train, word-split
EVAL_CONTEXT_WINDOW="${EVAL_CONTEXT_WINDOW:-0}"
PROMPT="${PROMPT:-The history of}"
SAMPLE_LEN="${SAMPLE_LEN:-40}"
SAMPLE_TOPK="${SAMPLE_TOPK:-10}"
NMT="${NMT:-1}"                            # 0: language model only
PARALLEL="${PARALLEL:-1}"                  # 1: the translation model trains beside the LM (one thread each)
NMT_DATA="${NMT_DATA:-data-bin/kjv_sparv_spm}"
NMT_VOCAB="${NMT_VOCAB:-4000}"
NMT_SAVE_DIR="${NMT_SAVE_DIR:-checkpoints/demo_nmt_moe}"
NMT_ARCH="${NMT_ARCH:-ts_transformer_tiny}"       # passed as ARCH, so an LM ARCH from the environment stays out
NMT_EXPERTS="${NMT_EXPERTS:-4}"
NMT_MAX_UPDATE="${NMT_MAX_UPDATE:-1600}"   # trains beside the LM (PARALLEL=1): valid BLEU 9.20 vs 5.29 at 800
NMT_LR="${NMT_LR:-5e-3}"
NMT_WARMUP="${NMT_WARMUP:-60}"
NMT_EMBED_DIM="${NMT_EMBED_DIM:-128}"
NMT_FFN_DIM="${NMT_FFN_DIM:-512}"
NMT_MAX_TOKENS="${NMT_MAX_TOKENS:-2048}"   # 800 x 2048 tokens: 25% lower valid ppl than 400 x 4096 at equal tokens
NMT_VALIDATE_INTERVAL="${NMT_VALIDATE_INTERVAL:-400}"
NMT_DROPOUT="${NMT_DROPOUT:-0.0}"
NMT_BEAM="${NMT_BEAM:-4}"
# fairseq-generate --no-repeat-ngram-size (0: off; works on CPU through torchscale_fairseq/compat/ngram_repeat_block.py).
NMT_NO_REPEAT_NGRAM="${NMT_NO_REPEAT_NGRAM:-3}"
NMT_MAX_LEN_B="${NMT_MAX_LEN_B:-40}"   # fairseq-generate's and the transformers translation's --max-len-b
PLOT_DIR="${PLOT_DIR:-checkpoints/demo_plots}"

PY="$VENV/bin/python"
USER_DIR="$ROOT/torchscale_fairseq"
say() { echo "[demo] $*"; }
for flag in SKIP_INSTALL NMT PARALLEL; do
  case "${!flag}" in
    0|1) ;;
    *) echo "[demo] error: $flag=${!flag}: set it to 0 or 1" >&2; exit 2 ;;
  esac
done

if [ "$SKIP_INSTALL" != 1 ]; then
  say "installing into $VENV"
  bash "$ROOT/scripts/install.sh"
fi
[ -x "$PY" ] || { echo "[demo] error: $PY not found; fix: bash scripts/install.sh" >&2; exit 1; }

logged_updates() {
  [ -f "$SAVE_DIR/train.log" ] || return 0
  sed -n 's/.*"\(train_\)\{0,1\}num_updates": "\([0-9]*\)".*/\2/p' "$SAVE_DIR/train.log" | tail -n 1
}

# Step 2: the LM data.
lm_data() {
  prepared=1
  for f in dict.txt train.bin train.idx valid.bin valid.idx test.bin test.idx; do
    [ -f "$DATA_DIR/$f" ] || prepared=0
  done
  if [ "$prepared" = 1 ]; then
    say "using the prepared data in $DATA_DIR"
  else
    say "preparing $DATA_DIR (gensim Wikipedia excerpt, GPT-2 BPE)"
    "$PY" -m data_prep.prepare_lm --out-dir "$DATA_DIR" ${MAX_DOCS:+--max-docs "$MAX_DOCS"}
  fi
}

# Step 3: LM training (resumes from $SAVE_DIR/checkpoint_last.pt).
lm_train() {
  mkdir -p "$SAVE_DIR"
  DONE="$(logged_updates)"
  if [ -f "$SAVE_DIR/checkpoint_best.pt" ] && [ "${DONE:-0}" -ge "$MAX_UPDATE" ]; then
    say "already trained ($DONE updates in $SAVE_DIR); remove it or raise MAX_UPDATE to train more"
  else
    if [ -n "$ADAPTIVE_CUTOFF" ]; then
      OUTPUT_ARGS=(--criterion adaptive_loss --ddp-backend legacy_ddp --adaptive-softmax-cutoff "$ADAPTIVE_CUTOFF"
        --adaptive-softmax-factor "$ADAPTIVE_FACTOR" --adaptive-input --adaptive-input-factor "$ADAPTIVE_FACTOR"
        --tie-adaptive-weights --tie-adaptive-proj)
    else
      OUTPUT_ARGS=(--share-decoder-input-output-embed)
    fi
    say "training $ARCH ($BACKBONE) up to $MAX_UPDATE updates on CPU; log: $SAVE_DIR/train.log"
    # shellcheck disable=SC2086  # EXTRA_TRAIN_ARGS is split into words on purpose
    "$VENV/bin/fairseq-train" "$DATA_DIR" --user-dir "$USER_DIR" \
      --task language_modeling --arch "$ARCH" --backbone "$BACKBONE" --dropout "$DROPOUT" "${OUTPUT_ARGS[@]}" \
      --tokens-per-sample "$TOKENS_PER_SAMPLE" --sample-break-mode none \
      --optimizer adam --adam-betas '(0.9,0.98)' --lr "$LR" --weight-decay "$WEIGHT_DECAY" \
      --lr-scheduler polynomial_decay --warmup-updates "$WARMUP_UPDATES" --total-num-update "$MAX_UPDATE" \
      --batch-size "$BATCH_SIZE" --max-update "$MAX_UPDATE" --seed "$SEED" --cpu \
      --save-dir "$SAVE_DIR" --log-format json --log-interval "$LOG_INTERVAL" \
      --validate-interval-updates "$VALIDATE_INTERVAL" --no-epoch-checkpoints $EXTRA_TRAIN_ARGS 2>&1 | tee -a "$SAVE_DIR/train.log"
  fi
  [ -f "$SAVE_DIR/checkpoint_best.pt" ] || { echo "[demo] error: training wrote no $SAVE_DIR/checkpoint_best.pt; see $SAVE_DIR/train.log" >&2; exit 1; }
}

# Step 4: validation perplexity, the unigram baseline and a sample (sets VALID_PPL, VALID_LOSS, UNIGRAM_PPL, SAMPLE).
lm_report() {
  say "evaluating on the valid split; log: $SAVE_DIR/eval_valid.log"
  "$VENV/bin/fairseq-eval-lm" "$DATA_DIR" --user-dir "$USER_DIR" \
    --path "$SAVE_DIR/checkpoint_best.pt" --gen-subset valid \
    --tokens-per-sample "$TOKENS_PER_SAMPLE" --context-window "$EVAL_CONTEXT_WINDOW" \
    --batch-size "$BATCH_SIZE" --cpu > "$SAVE_DIR/eval_valid.log" 2>&1 \
    || { tail -n 5 "$SAVE_DIR/eval_valid.log" >&2; echo "[demo] error: fairseq-eval-lm failed; see $SAVE_DIR/eval_valid.log" >&2; exit 1; }
  VALID_PPL="$(sed -n 's/.*Perplexity: \([0-9.]*\).*/\1/p' "$SAVE_DIR/eval_valid.log" | tail -n 1)"
  VALID_LOSS="$(sed -n 's/.*Loss (base 2): \([0-9.]*\),.*/\1/p' "$SAVE_DIR/eval_valid.log" | tail -n 1)"
  UNIGRAM_PPL="$("$PY" -m data_prep.unigram_ppl "$DATA_DIR" --subset valid 2> "$SAVE_DIR/unigram.log" | sed -n 's/^unigram_ppl //p')" \
    || { tail -n 5 "$SAVE_DIR/unigram.log" >&2; echo "[demo] error: the unigram baseline failed; see $SAVE_DIR/unigram.log" >&2; exit 1; }

  say "sampling a continuation of: $PROMPT"
  SAMPLE="$("$PY" -m data_prep.sample_lm --checkpoint-dir "$SAVE_DIR" --data "$DATA_DIR" \
    --prompt "$PROMPT" --max-len "$SAMPLE_LEN" --topk "$SAMPLE_TOPK" --seed "$SEED" \
    --user-dir "$USER_DIR" 2> "$SAVE_DIR/sample.log" | tail -n 1)" \
    || { tail -n 5 "$SAVE_DIR/sample.log" >&2; echo "[demo] error: sampling failed; see $SAVE_DIR/sample.log" >&2; exit 1; }
}

lm_steps() { lm_data; lm_train; lm_report; }

# Step 5, first half: the translation data and training (resumable).
nmt_train() {
  if [ -f "$NMT_DATA/spm.model" ] && [ -f "$NMT_DATA/test.en-es.es.idx" ]; then
    say "using the prepared translation data in $NMT_DATA"
  else
    say "preparing $NMT_DATA (KJV / Reina-Valera 1909 verse pairs, joint SentencePiece $NMT_VOCAB)"
    "$PY" -m data_prep.prepare_nmt --out-dir "$NMT_DATA" --vocab-size "$NMT_VOCAB" --force
  fi
  say "training a small X-MoE translation model ($NMT_EXPERTS experts, SparseClip) up to $NMT_MAX_UPDATE updates"
  SCALE=tiny ARCH="$NMT_ARCH" DATA="$NMT_DATA" SAVE_DIR="$NMT_SAVE_DIR" EXPERTS="$NMT_EXPERTS" CLIP=sparse \
    MAX_UPDATE="$NMT_MAX_UPDATE" EMBED_DIM="$NMT_EMBED_DIM" FFN_DIM="$NMT_FFN_DIM" HEADS=4 DROPOUT="$NMT_DROPOUT" \
    MAX_TOKENS="$NMT_MAX_TOKENS" TOTAL_TOKENS="$NMT_MAX_TOKENS" LR="$NMT_LR" \
    WARMUP="$NMT_WARMUP" LOG_INTERVAL="$LOG_INTERVAL" SEED="$SEED" VENV="$VENV" EXTRA_ARGS="--validate-interval-updates $NMT_VALIDATE_INTERVAL" \
    bash "$ROOT/scripts/nmt/train_moe.sh"
}

# Step 5, second half: BLEU / chrF of the model and of copying the source (sets BLEU, CHRF, BLEU_SIGNATURE, COPY_*).
nmt_report() {
  say "BLEU and chrF on the held-out test set"
  SCALE=tiny DATA="$NMT_DATA" SAVE_DIR="$NMT_SAVE_DIR" BEAM="$NMT_BEAM" MAX_LEN_B="$NMT_MAX_LEN_B" VENV="$VENV" \
    EXTRA_ARGS="--no-repeat-ngram-size $NMT_NO_REPEAT_NGRAM" \
    bash "$ROOT/scripts/nmt/evaluate.sh"
  BLEU="$(sed -n 's/^bleu \(.*\)/\1/p' "$NMT_SAVE_DIR/bleu_test.txt")"
  CHRF="$(sed -n 's/^chrf \(.*\)/\1/p' "$NMT_SAVE_DIR/bleu_test.txt")"
  BLEU_SIGNATURE="$(sed -n 's/^bleu_signature \(.*\)/\1/p' "$NMT_SAVE_DIR/bleu_test.txt")"
  "$PY" -m data_prep.nmt_baseline --source "$NMT_DATA/raw/test.en" --reference "$NMT_DATA/raw/test.es" \
    --scores-out "$NMT_SAVE_DIR/copy_source_test.txt" > /dev/null
  COPY_BLEU="$(sed -n 's/^bleu \(.*\)/\1/p' "$NMT_SAVE_DIR/copy_source_test.txt")"
  COPY_CHRF="$(sed -n 's/^chrf \(.*\)/\1/p' "$NMT_SAVE_DIR/copy_source_test.txt")"
}

# Step 5, last: the translation model exported to transformers, one test verse translated through it
# (its tokenizer and generate(), the evaluation's beam and n-gram blocking; sets NMT_HF_*).
nmt_export() {
  local hf="$NMT_SAVE_DIR/hf" staging="$NMT_SAVE_DIR/hf.export"
  say "exporting the translation model to transformers ($hf) and translating a test verse with it"
  rm -rf "$staging"
  "$VENV/bin/ts-export-hf" "$NMT_SAVE_DIR/checkpoint_best.pt" "$staging" > "$NMT_SAVE_DIR/export.log" 2>&1 \
    || { tail -n 5 "$NMT_SAVE_DIR/export.log" >&2; echo "[demo] error: ts-export-hf failed; see $NMT_SAVE_DIR/export.log" >&2; exit 1; }
  rm -rf "$hf" && mv "$staging" "$hf"   # the demo's own export of an earlier run: replaced by this checkpoint's
  NMT_HF_SOURCE="$(head -n 1 "$NMT_DATA/raw/test.en")"
  NMT_HF_ARGS=(--folder "$hf" --beam "$NMT_BEAM" --max-len-a 1.2 --max-len-b "$NMT_MAX_LEN_B" --no-repeat-ngram-size "$NMT_NO_REPEAT_NGRAM")
  NMT_HF_TRANSLATION="$("$PY" -m torchscale_fairseq.interop.hf_translate "${NMT_HF_ARGS[@]}" --text "$NMT_HF_SOURCE" \
    2> "$NMT_SAVE_DIR/hf_translate.log")" \
    || { tail -n 5 "$NMT_SAVE_DIR/hf_translate.log" >&2; echo "[demo] error: translating through transformers failed; see $NMT_SAVE_DIR/hf_translate.log" >&2; exit 1; }
}

# Steps 2-5. With NMT=1 and PARALLEL=1 (default) the translation model trains beside the language model,
# one thread each (two small models train faster side by side than one after the other on two threads);
# its output goes to $NMT_SAVE_DIR/demo.log. PARALLEL=0: one after the other, all threads each.
BLEU="-" CHRF="-" COPY_BLEU="-" COPY_CHRF="-"
NMT_PID=""
if [ "$NMT" = 1 ] && [ "$PARALLEL" = 1 ]; then
  mkdir -p "$NMT_SAVE_DIR"
  say "training the translation model beside the language model, one thread each; its output: $NMT_SAVE_DIR/demo.log"
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nmt_train > "$NMT_SAVE_DIR/demo.log" 2>&1 &
  NMT_PID=$!
  trap '[ -z "$NMT_PID" ] || kill "$NMT_PID" 2> /dev/null || true' EXIT  # the LM part failed: stop it too (it resumes)
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 lm_steps
else
  lm_steps
fi
PLOT_LOGS=("$SAVE_DIR/train.log")
if [ "$NMT" = 1 ]; then
  if [ -n "$NMT_PID" ]; then
    say "waiting for the translation model ($NMT_SAVE_DIR/demo.log)"
    wait "$NMT_PID" || { tail -n 5 "$NMT_SAVE_DIR/demo.log" >&2; NMT_PID=""
      echo "[demo] error: translation training failed; see $NMT_SAVE_DIR/demo.log" >&2; exit 1; }
    NMT_PID=""
    grep '^\[' "$NMT_SAVE_DIR/demo.log" | grep -v 'INFO\|WARNING' || true
  else
    nmt_train
  fi
  nmt_report
  nmt_export
  PLOT_LOGS+=("$NMT_SAVE_DIR/train.log")
fi
say "plots into $PLOT_DIR"
"$PY" -m torchscale_fairseq.cli.plot_logs "${PLOT_LOGS[@]}" --out-dir "$PLOT_DIR" 2>&1 | grep -v tensorboardX || true

UPDATES="$(logged_updates)"
echo
echo "================ demo summary ================"
echo "data:        $DATA_DIR (GPT-2 BPE; fairseq id = GPT-2 id + 4)"
echo "model:       $ARCH, backbone $BACKBONE, ${ADAPTIVE_CUTOFF:+adaptive input/softmax at $ADAPTIVE_CUTOFF, }${UPDATES:-?} updates, $SAVE_DIR/checkpoint_best.pt"
echo "export:      $VENV/bin/ts-export-hf $SAVE_DIR/checkpoint_best.pt $SAVE_DIR/hf  (a transformers folder, loaded with trust_remote_code=True: docs/interop.md)"
echo "valid:       perplexity ${VALID_PPL:-?} (loss ${VALID_LOSS:-?} bits/token) on the held-out articles"
echo "baseline:    perplexity ${UNIGRAM_PPL:-?} for word frequencies alone (add-one unigram of the training tokens);"
echo "             unigram / model = $(awk -v m="${VALID_PPL:-0}" -v u="${UNIGRAM_PPL:-0}" 'BEGIN { if (m > 0) printf "%.2fx", u / m; else printf "?" }'): what the model gains from context (1x: nothing beyond word frequencies)"
echo "sample:      $SAMPLE"
if [ "$NMT" = 1 ]; then
  echo "nmt data:    $NMT_DATA (KJV -> Reina-Valera 1909, $(wc -l < "$NMT_DATA/raw/train.en") train / $(wc -l < "$NMT_DATA/raw/test.en") test pairs)"
  echo "nmt model:   X-MoE $NMT_ARCH, $NMT_EXPERTS experts, SparseClip, $NMT_SAVE_DIR"
  echo "nmt test:    BLEU $BLEU, chrF $CHRF on the held-out test verses ($NMT_SAVE_DIR/bleu_test.txt; sacrebleu ${BLEU_SIGNATURE:-?})"
  echo "baseline:    BLEU $COPY_BLEU, chrF $COPY_CHRF for copying the English verse unchanged (shared names and numbers only)"
  echo "nmt export:  $NMT_SAVE_DIR/hf, in Python: AutoModelForSeq2SeqLM / AutoTokenizer.from_pretrained(folder, trust_remote_code=True)"
  echo "             translate: $PY -m torchscale_fairseq.interop.hf_translate ${NMT_HF_ARGS[*]} --text \"TEXT\""
  echo "through transformers: $NMT_HF_SOURCE"
  echo "          -> $NMT_HF_TRANSLATION"
fi
echo "plots:       $PLOT_DIR/*.png"
echo "wall time:   $((SECONDS / 60)) min $((SECONDS % 60)) s (setup, data, training, evaluation)"
