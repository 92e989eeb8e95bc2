#!/usr/bin/env bash
# X-MoE decoder-only LM, TorchScale paper Table 2: the dense recipe of train_dense.sh (12 layers)
# with EXPERTS experts (16/64/256) in every MOE_FREQ-th (2) layer, top-TOP_K (2) routing and
# balance loss weight BALANCE (0.01). CLIP=sparse (default: SparseClip) or CLIP=vanilla
# clipping at CLIP_NORM (1.0) compares the two (paper Figure 3).
# Experts are spread over the data-parallel ranks; with several ranks the checkpoints are
# sharded per rank and scripts/lm/evaluate.sh consolidates them.
# SCALE=tiny: 4 experts, 2 layers, d=64, 30 updates on CPU.
#   e.g.  EXPERTS=64 CLIP=vanilla NPROC_PER_NODE=8 bash scripts/lm/train_moe.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ts_lm_setup
ts_moe_setup
SAVE_DIR="${SAVE_DIR:-checkpoints/lm_moe${EXPERTS}_${CLIP}clip_${BACKBONE}_L${LAYERS}_${SCALE}}"
ts_train "$SAVE_DIR" "${TRAIN_ARGS[@]}" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${OPT_ARGS[@]}" \
  --criterion moe_cross_entropy
say "done: $SAVE_DIR"
