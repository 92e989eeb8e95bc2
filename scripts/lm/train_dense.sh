#!/usr/bin/env bash
# Dense decoder-only LM, TorchScale paper Table 1 (hidden 1024, FFN 4096, 16 heads, lr 5e-4,
# Adam (0.9, 0.98), polynomial decay, 750 warm-up, dropout 0.1, attention dropout 0.1, weight
# decay 0.01, 2048 samples x 128 tokens per update, 50K updates), GPT-2 BPE data from
#   python -m data_prep.prepare_lm --out-dir data-bin/enwiki_gpt2          (or --corpus web)
# Depth via LAYERS (12/24/48/96), residual form via BACKBONE (magneto, deepnorm, preln, postln).
# SCALE=tiny: a 2-layer d=64 model, 30 updates on CPU (DATA defaults to data-bin/enwiki_gpt2_tiny, from
#   python -m data_prep.prepare_lm --max-docs 30 --out-dir data-bin/enwiki_gpt2_tiny).
# Other knobs: DATA SAVE_DIR LR WARMUP MAX_UPDATE TOTAL_BATCH BATCH_SIZE CLIP_NORM EXTRA_ARGS,
# NNODES NPROC_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT SLURM MP PP DEVICE PRECISION ZERO (see scripts/common.sh).
#   e.g.  LAYERS=48 BACKBONE=deepnorm NPROC_PER_NODE=8 bash scripts/lm/train_dense.sh
#   sharded (FSDP2, bf16 compute over fp32 shards; TP 2 x FSDP 4 with sequence parallelism):
#         LAYERS=48 ZERO=full MP=2 NPROC_PER_NODE=8 EXTRA_ARGS=--sequence-parallel bash scripts/lm/train_dense.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ts_lm_setup
ts_default CLIP_NORM 0.0 0.0
SAVE_DIR="${SAVE_DIR:-checkpoints/lm_dense_${BACKBONE}_L${LAYERS}_${SCALE}}"
ts_train "$SAVE_DIR" "${TRAIN_ARGS[@]}" "${MODEL_ARGS[@]}" --criterion cross_entropy \
  --optimizer adam --adam-betas "(0.9,0.98)" --clip-norm "$CLIP_NORM"
say "done: $SAVE_DIR"
