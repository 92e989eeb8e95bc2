#!/usr/bin/env bash
# Run on a machine with PyPI access (after scripts/install.sh): download into scripts/gpu/wheelhouse/
# (git-ignored) everything an offline GPU node with Python 3.12 and a CUDA PyTorch needs to run
# scripts/gpu/run_gpu_check.sh, and prebuild fairseq-fixed's wheel against the node's torch. Nothing
# for torch. See scripts/gpu/README.md.
#   bash scripts/gpu/prepare_offline.sh                   # core + fallback wheels + fairseq wheel
#   GPU_WHEELS=core bash scripts/gpu/prepare_offline.sh   # no fallback wheels (the node has them)
#   FAIRSEQ_WHEEL_PYTHON=none bash scripts/gpu/prepare_offline.sh   # no prebuilt fairseq wheel: built on the node
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WH="${WHEELHOUSE:-$ROOT/scripts/gpu/wheelhouse}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"    # needs torch, numpy and cython: fairseq's metadata is read without isolation
NODE_PY="${GPU_PYTHON_VERSION:-3.12}"
# A Python like the node's (CPython 3.12, torch 2.11.0, numpy 2.x, cython, setuptools, a C++ compiler)
# that builds fairseq-fixed's wheel: its C++ extensions (libbase, libnat, alignment_train_cpu_binding)
# link against that torch, so the node can install it in seconds instead of compiling for minutes.
# Default: the stand-in of scripts/gpu/make_node_standin.sh, where it exists; `none`: no wheel.
FAIRSEQ_WHEEL_PYTHON="${FAIRSEQ_WHEEL_PYTHON:-${STANDIN:-/work/nodesim/base}/bin/python}"
CACHE="${GPU_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torchscale-fairseq/gpu-wheels}"
LIMIT_MIB=48                              # the node gets at most 64 MiB of carried files, the checkout included

# Everything is installed on the node with --no-deps: each list names every package it needs.
# core: fairseq-fixed 0.12.3.1's pins and their dependencies that a CUDA PyTorch image lacks
# (hydra-core -> omegaconf, antlr4-python3-runtime, packaging; omegaconf -> pyyaml; cffi -> pycparser).
# torchao 0.17.0 (3.1 MiB, no dependencies): --fp8's float8 training, the release built against torch 2.11.
CORE=(hydra-core==1.3.2 omegaconf==2.3.0 bitarray==3.12.3 cffi==2.1.1 pycparser==3.12 torchao==0.17.0)
# fallback: what fairseq or the plugin imports that such images usually hold already; the node
# installs one only where it has no version of that distribution (sacrebleu -> portalocker, tabulate,
# colorama, regex, lxml; lxml is not shipped: the node image has it).
FALLBACK=(cython==3.3.1 regex==2026.11.15 sacrebleu==2.6.0 portalocker==4.4.2 tabulate==0.10.0 colorama==0.4.6
          sentencepiece==0.2.2 tiktoken==0.14.0 pyyaml==6.0.3)
# Source-only packages: pure Python ones are built into wheels here; fairseq-fixed's source stays as
# the fallback the node compiles when the prebuilt wheel does not match its torch.
PURE_SDISTS=(antlr4-python3-runtime==4.9.3 openai-whisper==20250625)
CORE_SDISTS=(antlr4-python3-runtime==4.9.3 openai-whisper==20250625)  # openai-whisper: only its GPT-2 BPE ranks
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
echo "[prepare] $FAIRSEQ source distribution"
"${PIP[@]}" download --no-deps --no-binary :all: --no-build-isolation -d "$WH" "$FAIRSEQ"
SDIST="$(ls "$WH"/fairseq_fixed-*.tar.gz | head -n 1)"

# fairseq-fixed's wheel, built against the node's torch (cached by source and torch version)
rm -f "$WH/fairseq-wheel.txt"
if [ "$FAIRSEQ_WHEEL_PYTHON" != none ] && [ -x "$FAIRSEQ_WHEEL_PYTHON" ]; then
  RECORD="$("$FAIRSEQ_WHEEL_PYTHON" -c 'import sys, numpy, torch
print(f"python={sys.version_info[0]}.{sys.version_info[1]} torch={torch.__version__} numpy={numpy.__version__} "
      f"cxx11abi={int(torch.compiled_with_cxx11_abi())}")')"
  case "$RECORD" in
    "python=$NODE_PY "*) ;;
    *) echo "[prepare] error: $FAIRSEQ_WHEEL_PYTHON is not CPython $NODE_PY ($RECORD): set FAIRSEQ_WHEEL_PYTHON" >&2; exit 2 ;;
  esac
  KEY="$(echo "$RECORD $(sha256sum "$SDIST" | cut -c1-16)" | sha256sum | cut -c1-16)"
  mkdir -p "$CACHE/$KEY"
  if ! ls "$CACHE/$KEY"/fairseq_fixed-*.whl >/dev/null 2>&1; then
    echo "[prepare] building fairseq-fixed's wheel with $FAIRSEQ_WHEEL_PYTHON ($RECORD; CPU extensions only, minutes)"
    t0=$SECONDS
    env -u CUDA_HOME MAX_JOBS="$(nproc)" PIP_CONFIG_FILE=/dev/null \
      "$FAIRSEQ_WHEEL_PYTHON" -m pip --disable-pip-version-check -q wheel --no-deps --no-build-isolation --no-index \
      -w "$CACHE/$KEY" "$SDIST"
    echo "[prepare] built in $((SECONDS - t0)) s"
  fi
  # without the extensions' debug information (30 MiB of the 31 MiB they take): the wheel travels
  TMPW="$(mktemp -d)"
  if command -v strip >/dev/null 2>&1 && "$FAIRSEQ_WHEEL_PYTHON" -m wheel version >/dev/null 2>&1; then
    "$FAIRSEQ_WHEEL_PYTHON" -m wheel unpack -d "$TMPW" "$CACHE/$KEY"/fairseq_fixed-*.whl >/dev/null
    find "$TMPW" -name '*.so' -exec strip --strip-debug {} +
    "$FAIRSEQ_WHEEL_PYTHON" -m wheel pack -d "$WH" "$TMPW"/fairseq_fixed-* >/dev/null
  else
    cp "$CACHE/$KEY"/fairseq_fixed-*.whl "$WH/"
  fi
  rm -rf "$TMPW"
  echo "$(basename "$(ls "$WH"/fairseq_fixed-*.whl)") $RECORD" > "$WH/fairseq-wheel.txt"
  echo "[prepare] fairseq wheel: $(cat "$WH/fairseq-wheel.txt")"
else
  echo "[prepare] no prebuilt fairseq wheel (FAIRSEQ_WHEEL_PYTHON=$FAIRSEQ_WHEEL_PYTHON): the node builds it from source"
fi

# What run_gpu_check.sh installs (it checks every file is here), always with --no-deps: core.txt,
# fallback.txt where the node lacks the distribution, then fairseq (fairseq-wheel.txt if its record
# matches the node, else fairseq.txt built from source without build isolation).
{
  printf '%s\n' "${CORE[@]}" "${CORE_SDISTS[@]}"
} > "$WH/core.txt"
if [ "${GPU_WHEELS:-all}" = all ]; then printf '%s\n' "${FALLBACK[@]}" > "$WH/fallback.txt"; else : > "$WH/fallback.txt"; fi
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
