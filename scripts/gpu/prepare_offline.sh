#!/usr/bin/env bash
# Run on a machine with PyPI access (after scripts/install.sh): download into scripts/gpu/wheelhouse/
# (git-ignored) everything an offline GPU node with Python 3.12 and a CUDA PyTorch needs to run
# scripts/gpu/run_gpu_check.sh. Nothing for torch. See scripts/gpu/README.md.
#   bash scripts/gpu/prepare_offline.sh            # core + fallback wheels
#   GPU_WHEELS=core bash scripts/gpu/prepare_offline.sh   # core only (the node already has the rest)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WH="${WHEELHOUSE:-$ROOT/scripts/gpu/wheelhouse}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"    # needs torch, numpy and cython: fairseq's metadata is read without isolation
NODE_PY="${GPU_PYTHON_VERSION:-3.12}"
LIMIT_MIB=48                              # the node gets at most 64 MiB of carried files, the checkout included

# Binary wheels (manylinux x86_64 or pure Python) for the node's Python. core: what fairseq-fixed
# 0.12.3.1 pins and a CUDA PyTorch image lacks; fallback: what the plugin needs that such images
# usually hold already (pip keeps the node's own copy when it satisfies the requirement).
CORE=(hydra-core==1.3.2 omegaconf==2.3.0 bitarray==3.12.3 cffi==2.1.1 pycparser==3.12)
FALLBACK=(cython==3.3.1 regex==2026.11.15 sacrebleu==2.6.0 portalocker==4.4.2 tabulate==0.10.0 colorama==0.4.6
          sentencepiece==0.2.3 tiktoken==0.14.0 pyyaml==6.0.3)
# Source-only packages: pure Python ones are built into wheels here; fairseq-fixed stays a source
# distribution, compiled on the node against its torch (C++ extensions must match that torch).
PURE_SDISTS=(antlr4-python3-runtime==4.9.3 openai-whisper==20250625)
NO_DEPS=(openai-whisper==20250625)  # only its GPT-2 BPE ranks file is used (as scripts/install.sh installs it)
FAIRSEQ=fairseq-fixed==0.12.3.1

case "${GPU_WHEELS:-all}" in
  all) BINARIES=("${CORE[@]}" "${FALLBACK[@]}") ;;
  core) BINARIES=("${CORE[@]}") ;;
  *) echo "[prepare] error: GPU_WHEELS=${GPU_WHEELS} is neither all nor core" >&2; exit 2 ;;
esac
[ -x "$PY" ] || { echo "[prepare] error: $PY not found: run scripts/install.sh first or set PYTHON" >&2; exit 2; }
rm -rf "$WH"
mkdir -p "$WH"
PIP=("$PY" -m pip --disable-pip-version-check -q)
echo "[prepare] binary wheels for CPython $NODE_PY, manylinux x86_64: ${BINARIES[*]}"
"${PIP[@]}" download --no-deps --only-binary=:all: --python-version "$NODE_PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WH" "${BINARIES[@]}"
echo "[prepare] pure-Python wheels built here: ${PURE_SDISTS[*]}"
"${PIP[@]}" wheel --no-deps --no-build-isolation -w "$WH" "${PURE_SDISTS[@]}"
echo "[prepare] $FAIRSEQ source distribution (built on the node)"
"${PIP[@]}" download --no-deps --no-binary :all: --no-build-isolation -d "$WH" "$FAIRSEQ"
# What run_gpu_check.sh installs (it checks every file is here): requirements.txt with their
# dependencies, no-deps.txt without, then fairseq.txt built from source without build isolation.
{
  printf '%s\n' "${CORE[@]}" antlr4-python3-runtime==4.9.3
  if [ "${GPU_WHEELS:-all}" = all ]; then printf '%s\n' "${FALLBACK[@]}"; fi
} > "$WH/requirements.txt"
printf '%s\n' "${NO_DEPS[@]}" > "$WH/no-deps.txt"
echo "$FAIRSEQ" > "$WH/fairseq.txt"
"$PY" - "$WH" <<'PY'
import hashlib, pathlib, sys
wh = pathlib.Path(sys.argv[1])
lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in sorted(wh.iterdir()) if p.name != "SHA256SUMS"]
(wh / "SHA256SUMS").write_text("\n".join(lines) + "\n")
PY
SIZE_KIB="$(du -sk "$WH" | cut -f1)"
ls -l "$WH"
echo "[prepare] $WH: $(ls "$WH" | wc -l) files, $((SIZE_KIB / 1024)) MiB"
if [ "$SIZE_KIB" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "[prepare] error: over $LIMIT_MIB MiB: use GPU_WHEELS=core" >&2
  exit 1
fi
