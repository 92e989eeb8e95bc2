#!/bin/bash
# $1: the repository to import the plugin from; prints dynamo's traced frames and graph breaks of two updates
V=/tmp/ts-compat-matrix/py312-torch211/venv   # Python 3.12, torch 2.11.0+cu130 (the GPU node's), run on the CPU
D=/work/main/outputs/gpu_speed_data/data-bin
env PYTHONPATH=$1 OMP_NUM_THREADS=2 TORCH_LOGS=graph_breaks,dynamo TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \
  $V/bin/fairseq-train $D --task language_modeling --tokens-per-sample 128 --sample-break-mode none \
  --share-decoder-input-output-embed --dropout 0.1 --cpu --bf16 --lr 5e-4 --batch-size 1 --log-format json \
  --disable-validation --no-save --seed 1 --num-workers 0 --user-dir $1/torchscale_fairseq --arch ts_lm_large \
  --decoder-layers 1 --decoder-embed-dim 256 --decoder-attention-heads 4 --decoder-ffn-embed-dim 1024 \
  --backbone magneto --ts-fused-cross-entropy --ts-compile --optimizer ts_adamw --ts-sync-free-step \
  --max-update 2 --save-dir $(mktemp -d) 2>&1 \
  | grep -E "torchdynamo start tracing|Graph Break Reason|Debug representation|Developer debug context|--ts-compile:" \
  | sed -E 's/^[IVW][0-9]+ [0-9:.]+ [0-9]+ //'
