#!/usr/bin/env bash
# Long-context dense decoder-only LM: the model of train_dense.sh (12 layers, hidden 1024, FFN 4096,
# 16 heads) on blocks of 32768 tokens, each split over CP=4 context-parallel ranks (rank c holds
# chunks c and 7-c of 8, causal attention by a ring of keys/values) and MP=2 tensor-parallel parts
# with --sequence-parallel and selective recomputation: 8 GPUs, rank t + 2 (c + 4 (d + D p)).
# 16 blocks (512K tokens) per update, one block per forward, bf16; attention dropout 0 (the ring has
# none). TOKENS_PER_SAMPLE must be a multiple of 2 x CP x MP.
# GPT-2 BPE data from  python -m data_prep.prepare_lm --out-dir data-bin/enwiki_gpt2
# SCALE=tiny: a 2-layer d=64 model on 64-token blocks at CP=2 x MP=2 (4 CPU processes), 30 updates.
# Other knobs: DATA SAVE_DIR LAYERS LR WARMUP MAX_UPDATE TOTAL_BATCH BATCH_SIZE CLIP_NORM PRECISION
# EXTRA_ARGS, NNODES NPROC_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT SLURM MP PP CP DEVICE
# (see scripts/common.sh); evaluate with  MP=2 TOKENS_PER_SAMPLE=... SAVE_DIR=... bash scripts/lm/evaluate.sh
#   e.g.  bash scripts/lm/train_long_context.sh            (one node of 8 GPUs)
#         CP=8 NNODES=2 NODE_RANK=$NODE MASTER_ADDR=$HEAD bash scripts/lm/train_long_context.sh
[ "${SCALE:-full}" = tiny ] && CP="${CP:-2}"
CP="${CP:-4}"
MP="${MP:-2}"
PRECISION="${PRECISION:-bf16}"
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ts_default TOKENS_PER_SAMPLE 32768 64
ts_default TOTAL_BATCH 16 8
ts_default BATCH_SIZE 1 4
ts_default ATTENTION_DROPOUT 0.0 0.0
ts_int TOKENS_PER_SAMPLE
[ $((TOKENS_PER_SAMPLE % (2 * CP * MP))) = 0 ] \
  || die "TOKENS_PER_SAMPLE=$TOKENS_PER_SAMPLE does not split into 2 x CP x MP = $((2 * CP * MP)) equal chunks: use a multiple of it"
ts_lm_setup
ts_default CLIP_NORM 1.0 1.0
SP_ARGS=()
[ "$MP" -le 1 ] || SP_ARGS=(--sequence-parallel)
SAVE_DIR="${SAVE_DIR:-checkpoints/lm_long${TOKENS_PER_SAMPLE}_cp${CP}_mp${MP}_${BACKBONE}_L${LAYERS}_${SCALE}}"
ts_train "$SAVE_DIR" "${TRAIN_ARGS[@]}" "${MODEL_ARGS[@]}" "${SP_ARGS[@]}" --checkpoint-activations selective \
  --criterion cross_entropy --optimizer adam --adam-betas "(0.9,0.98)" --clip-norm "$CLIP_NORM"
say "done: $SAVE_DIR"
