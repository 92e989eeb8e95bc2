#!/usr/bin/env bash
# BLEU and chrF of a trained NMT model on a held-out split: fairseq-generate (beam search), then
# SentencePiece decoding with the data's spm.model and sacrebleu against the raw reference text
# (DATA/raw/SUBSET.TGT_LANG written by data_prep.prepare_nmt).
#   SAVE_DIR=checkpoints/nmt_dense_magneto_L12-12_full bash scripts/nmt/evaluate.sh
# Knobs: SAVE_DIR (required), DATA, SRC_LANG, TGT_LANG, SUBSET (test), CHECKPOINT (checkpoint_best),
# BEAM (5), LENPEN (1.0), MAX_TOKENS, SCALE, DEVICE, MP (the tensor-parallel size it was trained at; one
# process per part), EXTRA_ARGS.
# Writes SAVE_DIR/generate_SUBSET.txt (fairseq output), hyp_SUBSET.TGT_LANG (detokenised
# hypotheses) and bleu_SUBSET.txt ("bleu B", "chrf C", sacrebleu signatures), and prints them.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ -n "${SAVE_DIR:-}" ] || die "set SAVE_DIR to the training run's directory"
ts_default DATA data-bin/kjv_sparv_spm data-bin/kjv_sparv_spm_tiny
ts_default BEAM 5 2
ts_default MAX_TOKENS 8192 2048
ts_default MAX_LEN_B 256 40
SRC_LANG="${SRC_LANG:-en}"
TGT_LANG="${TGT_LANG:-es}"
SUBSET="${SUBSET:-test}"
LENPEN="${LENPEN:-1.0}"
ts_need_data "$DATA" spm.model "raw/$SUBSET.$TGT_LANG" "$SUBSET.$SRC_LANG-$TGT_LANG.$SRC_LANG.bin"
CKPT="$(ts_checkpoint "$SAVE_DIR" "${CHECKPOINT:-checkpoint_best}")"
GEN="$SAVE_DIR/generate_$SUBSET.txt"
say "fairseq-generate $CKPT on $DATA/$SUBSET (beam $BEAM); output: $GEN"
# shellcheck disable=SC2086  # EXTRA_ARGS is split into words on purpose
ts_launch fairseq-generate "$DATA" --user-dir "$USER_DIR" --path "$CKPT" --task translation \
  --source-lang "$SRC_LANG" --target-lang "$TGT_LANG" --gen-subset "$SUBSET" --beam "$BEAM" \
  --lenpen "$LENPEN" --max-len-a 1.2 --max-len-b "$MAX_LEN_B" --max-tokens "$MAX_TOKENS" --num-workers 0 \
  --required-batch-size-multiple 1 \
  "${DEVICE_ARGS[@]}" ${EXTRA_ARGS:-} > "$GEN" 2> "$SAVE_DIR/generate_$SUBSET.log" \
  || { tail -n 5 "$SAVE_DIR/generate_$SUBSET.log" >&2; die "fairseq-generate failed; see $SAVE_DIR/generate_$SUBSET.log"; }
"$PY" -m data_prep.score_nmt --generate-output "$GEN" --spm-model "$DATA/spm.model" \
  --reference "$DATA/raw/$SUBSET.$TGT_LANG" --hypothesis-out "$SAVE_DIR/hyp_$SUBSET.$TGT_LANG" \
  --scores-out "$SAVE_DIR/bleu_$SUBSET.txt"
