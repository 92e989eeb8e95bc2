#!/usr/bin/env bash
# A CPU stand-in for the offline GPU node, for rehearsing scripts/gpu/run_gpu_check.sh here:
# a Python 3.12 virtualenv (the node's python3 is itself one, /opt/torch/.venv) holding the node
# image's versions of what the check touches (torch 2.11.0, numpy 2.5.2, transformers 5.17.0, ...)
# and its other relevant packages (workplace device docs, KINDS.md), but none of hydra-core,
# omegaconf, antlr4, bitarray, cffi, fairseq: those must come from the wheelhouse. PyPI's torch 2.11.0
# is the CUDA build, which runs on a machine without a GPU (torch.cuda.is_available() is False).
#   bash scripts/gpu/make_node_standin.sh            # -> $STANDIN (default /work/nodesim/base)
#   STANDIN=/tmp/node TORCH_WHEELS=/path bash scripts/gpu/make_node_standin.sh
# Rehearsal (scripts/gpu/README.md, "Rehearsal"): the stand-in's bin/ first on PATH, inside
# `unshare -n` (no network), as python3.
set -euo pipefail
STANDIN="${STANDIN:-/work/nodesim/base}"
BASE_PY="${BASE_PYTHON:-/root/.pyenv/versions/3.12.1/bin/python3}"
# torch 2.11.0 for CPython 3.12 with its dependencies (nvidia-*, triton 3.6.0, ...), downloaded once:
#   pip download --only-binary=:all: --python-version 3.12 torch==2.11.0 -d DIR
TORCH_WHEELS="${TORCH_WHEELS:-/work/wheels/torch211-py312}"
# the node's versions (device KINDS.md, "pip list, as a session saw it")
PINNED=(numpy==2.5.2 transformers==5.17.0 safetensors==0.8.0 sentencepiece==0.2.2 tiktoken==0.14.0
        tokenizers==0.23.2 huggingface_hub==1.33.0 torchaudio==2.11.0)
# other packages the node image holds (KINDS.md, "Python packages already there"), versions unknown:
# what fairseq, the plugin, the tests and the benchmarks could import, and their dependencies
OTHERS=(cython pytest pytest-xdist pytest-timeout regex sacrebleu portalocker tabulate colorama lxml pyyaml tqdm
        scikit-learn scipy joblib threadpoolctl packaging setuptools wheel ninja psutil requests filelock)
ABSENT=(hydra-core omegaconf antlr4-python3-runtime bitarray cffi pycparser fairseq fairseq-fixed)

[ -x "$BASE_PY" ] || { echo "[standin] error: $BASE_PY not found: set BASE_PYTHON to a Python 3.12" >&2; exit 2; }
[ -d "$TORCH_WHEELS" ] || { echo "[standin] error: $TORCH_WHEELS not found: set TORCH_WHEELS (see the header)" >&2; exit 2; }
if [ -e "$STANDIN" ] && [ ! -f "$STANDIN/.ts_node_standin" ]; then
  echo "[standin] error: $STANDIN exists and is not a stand-in made by this script: choose another STANDIN" >&2
  exit 2
fi
rm -rf "$STANDIN"
mkdir -p "$(dirname "$STANDIN")"
"$BASE_PY" -m venv "$STANDIN"
touch "$STANDIN/.ts_node_standin"
PY="$STANDIN/bin/python"
# this machine's pip configuration caps torch (a constraints file): the stand-in takes exact pins
export PIP_CONSTRAINT=""
PIP=("$PY" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
echo "[standin] torch 2.11.0 from $TORCH_WHEELS (no index)"
"${PIP[@]}" install --no-index --find-links "$TORCH_WHEELS" torch==2.11.0
echo "[standin] ${PINNED[*]}"
"${PIP[@]}" install --find-links "$TORCH_WHEELS" "${PINNED[@]}" torch==2.11.0
echo "[standin] ${OTHERS[*]}"
"${PIP[@]}" install --find-links "$TORCH_WHEELS" "${OTHERS[@]}" torch==2.11.0 numpy==2.5.2
for name in "${ABSENT[@]}"; do
  if "$PY" -m pip show -q "$name" >/dev/null 2>&1; then
    echo "[standin] removing $name (the node does not have it)"
    "${PIP[@]}" uninstall -y "$name"
  fi
done
"$PY" - <<'PY'
import importlib.metadata as md
import sys

import torch

want = {"torch": "2.11.0", "numpy": "2.5.2", "transformers": "5.17.0", "safetensors": "0.8.0", "sentencepiece": "0.2.2",
        "tiktoken": "0.14.0", "tokenizers": "0.23.2", "huggingface_hub": "1.33.0", "triton": "3.6.0"}
got = {name: md.version(name) for name in want}
wrong = {k: v for k, v in got.items() if v.split("+")[0] != want[k]}
assert not wrong, f"versions differ from the node's: {wrong}"
print(f"[standin] python {sys.version.split()[0]}, torch {torch.__version__} (CUDA build {torch.version.cuda}, "
      f"CUDA available {torch.cuda.is_available()}); {', '.join(f'{k} {v}' for k, v in got.items() if k != 'torch')}")
PY
echo "[standin] $STANDIN: $(du -sh "$STANDIN" | cut -f1); python3 = $STANDIN/bin/python3"
