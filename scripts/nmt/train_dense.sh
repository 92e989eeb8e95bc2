#!/usr/bin/env bash
# Dense encoder-decoder NMT, TorchScale paper Table 3 (12-12 up to 96-96 layers via LAYERS, hidden
# 1024, FFN 4096, 16 heads, lr 5e-4, inverse sqrt, 6000 warm-up, 262K tokens per update, Adam
# (0.9, 0.98), label smoothing 0.1, clip 1.0, dropout 0.1, weight decay 0, 100K updates) on the
# SentencePiece data of
#   python -m data_prep.prepare_nmt --out-dir data-bin/kjv_sparv_spm       (or your own files)
# Residual form via BACKBONE (magneto, deepnorm, preln, postln).
# SCALE=tiny: 2-2 layers, d=64, 30 updates on CPU (DATA defaults to data-bin/kjv_sparv_spm_tiny, from
#   python -m data_prep.prepare_nmt --max-pairs 400 --valid-size 40 --test-size 40 --vocab-size 500 \
#     --out-dir data-bin/kjv_sparv_spm_tiny).
# Other knobs: DATA SRC_LANG TGT_LANG SAVE_DIR ENC_LAYERS DEC_LAYERS LR WARMUP MAX_UPDATE TOTAL_TOKENS
# MAX_TOKENS CLIP_NORM EXTRA_ARGS, NNODES NPROC_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT SLURM MP DEVICE.
#   e.g.  LAYERS=48 BACKBONE=postln NPROC_PER_NODE=8 bash scripts/nmt/train_dense.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ts_nmt_setup
SAVE_DIR="${SAVE_DIR:-checkpoints/nmt_dense_${BACKBONE}_L${ENC_LAYERS}-${DEC_LAYERS}_${SCALE}}"
ts_train "$SAVE_DIR" "${TRAIN_ARGS[@]}" "${MODEL_ARGS[@]}" --criterion label_smoothed_cross_entropy \
  --optimizer adam --adam-betas "(0.9,0.98)" --clip-norm "$CLIP_NORM"
say "done: $SAVE_DIR"
