#!/bin/bash
# TREE PY OUT: gpu_speed.py --toy's fast command (2 layers, width 64, --cpu) through train_profile.py with the speed
# table's window (updates 11-30), host profile (31-33) and profiled update (34), importing the plugin from TREE.
# DATA: the toy's data-bin (gpu_speed.py --toy --log-dir L writes it to L/data/data-bin).
# Made with PY = the py312-torch211 venv (torch 2.11.0+cu130 on the CPU): window_87db2cd.json with TREE a worktree
# of 87db2cd (before the compile fix), window_73135bf.json with TREE main at 73135bf.
TREE=$1; PY=$2; OUT=$3; shift 3
DATA=${DATA:-/tmp/toy/logs/data/data-bin}
cd "$TREE" && PYTHONPATH="$TREE" "$PY" benchmarks/train_profile.py --time 11:30 --host-profile 3 --profile 34 --tokens 128 \
  --out "$OUT" -- "$DATA" --task language_modeling --tokens-per-sample 64 --sample-break-mode none \
  --share-decoder-input-output-embed --dropout 0.1 --cpu --lr 5e-4 --batch-size 2 --log-format json --log-interval 100 \
  --disable-validation --no-save --seed 1 --num-workers 2 --user-dir "$TREE/torchscale_fairseq" --arch ts_lm_large \
  --decoder-layers 2 --decoder-embed-dim 64 --decoder-attention-heads 2 --decoder-ffn-embed-dim 128 --backbone magneto \
  --ts-fused-cross-entropy --ts-compile --optimizer ts_adamw --ts-sync-free-step --save-dir "$(mktemp -d)" "$@"
