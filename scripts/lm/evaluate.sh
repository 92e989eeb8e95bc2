#!/usr/bin/env bash
# Perplexity of a trained LM on a held-out split with fairseq-eval-lm.
#   SAVE_DIR=checkpoints/lm_dense_magneto_L12_full bash scripts/lm/evaluate.sh
# Knobs: SAVE_DIR (required), DATA, SUBSET (test), CHECKPOINT (checkpoint_best), TOKENS_PER_SAMPLE,
# CONTEXT_WINDOW (0), BATCH_SIZE, SCALE, DEVICE, MP (the tensor-parallel size it was trained at; one
# process per part). A pipelined checkpoint (PP > 1 in training) is merged into one stack first
# (ts-reshard --pipeline-size 1, into CHECKPOINT.one_stage.pt), so PP is not read here; nor CP (a
# context-parallel run saves the files of CP = 1). Writes
# SAVE_DIR/eval_SUBSET.txt ("perplexity P" and "loss_base2 L") and prints it; the full fairseq output is in
# eval_SUBSET.log.
PP=1
CP=1
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ -n "${SAVE_DIR:-}" ] || die "set SAVE_DIR to the training run's directory"
ts_default DATA data-bin/enwiki_gpt2 data-bin/enwiki_gpt2_tiny
ts_default TOKENS_PER_SAMPLE 128 64
ts_default BATCH_SIZE 16 8
SUBSET="${SUBSET:-test}"
CONTEXT_WINDOW="${CONTEXT_WINDOW:-0}"
ts_need_data "$DATA" dict.txt "$SUBSET.bin"
CKPT="$(ts_checkpoint "$SAVE_DIR" "${CHECKPOINT:-checkpoint_best}")"
LOG="$SAVE_DIR/eval_$SUBSET.log"
say "fairseq-eval-lm $CKPT on $DATA/$SUBSET; log: $LOG"
# shellcheck disable=SC2086  # EXTRA_ARGS is split into words on purpose
ts_launch fairseq-eval-lm "$DATA" --user-dir "$USER_DIR" --path "$CKPT" --gen-subset "$SUBSET" \
  --tokens-per-sample "$TOKENS_PER_SAMPLE" --context-window "$CONTEXT_WINDOW" --batch-size "$BATCH_SIZE" \
  --required-batch-size-multiple 1 --num-workers 0 "${DEVICE_ARGS[@]}" ${EXTRA_ARGS:-} > "$LOG" 2>&1 \
  || { tail -n 5 "$LOG" >&2; die "fairseq-eval-lm failed; see $LOG"; }
PPL="$(sed -n 's/.*Perplexity: \([0-9.]*\).*/\1/p' "$LOG" | tail -n 1)"
LOSS="$(sed -n 's/.*Loss (base 2): \([0-9.]*\),.*/\1/p' "$LOG" | tail -n 1)"
[ -n "$PPL" ] || die "no perplexity in $LOG"
printf 'subset %s\ncheckpoint %s\nperplexity %s\nloss_base2 %s\n' "$SUBSET" "$CKPT" "$PPL" "$LOSS" \
  | tee "$SAVE_DIR/eval_$SUBSET.txt"
