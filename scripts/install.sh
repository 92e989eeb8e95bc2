#!/usr/bin/env bash
# Create (or reuse) .venv and install torchscale-fairseq with everything it needs, offline-friendly:
# torch first (the CUDA or the CPU build, see below), fairseq built without build isolation.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
# Which PyTorch build: TORCH_BUILD=cuda where an NVIDIA driver answers (`nvidia-smi` runs), else cpu.
# cuda: the plain spec (PyPI's Linux torch wheels are CUDA builds). cpu: the spec from
# TORCH_CPU_INDEX (--index-url) when that index answers, else the plain spec (a local wheel
# directory or mirror with a +cpu wheel, as on the project's CI machine). TORCH_INDEX_URL
# overrides the index for either build; INSTALL_DRY_RUN=1 prints the decision and stops.
# Versions: setup.py declares the supported ranges (README, "Supported versions"); TORCH_SPEC picks
# the torch and NUMPY_SPEC (optional, installed last) the numpy within them, as
# scripts/compat_matrix.sh does for each end of the range.
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
if [ -z "${TORCH_BUILD:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then TORCH_BUILD=cuda; else TORCH_BUILD=cpu; fi
fi
case "$TORCH_BUILD" in
  cuda|cpu) ;;
  *) echo "[install] error: TORCH_BUILD=$TORCH_BUILD is neither cpu nor cuda: set TORCH_BUILD=cpu or TORCH_BUILD=cuda" >&2; exit 2 ;;
esac
PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "${PYVER%%.*}" -lt 3 ] || { [ "${PYVER%%.*}" = 3 ] && [ "${PYVER#*.}" -lt 11 ]; }; then
  echo "[install] error: $PY is Python $PYVER; torchscale-fairseq needs Python 3.11 or newer: set PYTHON=python3.11 (or 3.12, 3.13)" >&2; exit 2
fi
TORCH_INDEX=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  TORCH_INDEX=(--index-url "$TORCH_INDEX_URL")
elif [ "$TORCH_BUILD" = cpu ] && "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
    "$TORCH_CPU_INDEX" >/dev/null 2>&1; then
  TORCH_INDEX=(--index-url "$TORCH_CPU_INDEX")
fi
echo "[install] torch: build $TORCH_BUILD, pip install $TORCH_SPEC${TORCH_INDEX[*]:+ ${TORCH_INDEX[*]}}"
if [ "${INSTALL_DRY_RUN:-0}" = 1 ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# Offline corpora: SWORD Bible modules (KJV, Reina-Valera 1909, World English Bible) from Debian,
# installed only when missing and only where apt-get is available (as root, or through sudo).
SWORD_ZTEXT="${SWORD_PATH:-/usr/share/sword}/modules/texts/ztext"
if { [ ! -d "$SWORD_ZTEXT/engKJV2006eb" ] || [ ! -d "$SWORD_ZTEXT/spaRV1909eb" ] || [ ! -d "$SWORD_ZTEXT/engWEB2015eb" ]; } \
    && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  echo "[install] Debian packages sword-text-kjv sword-text-sparv sword-text-web"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    sword-text-kjv sword-text-sparv sword-text-web \
    || echo "[install] warning: could not install the SWORD modules; the NMT data and --corpus web need them" >&2
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# The lowest transformers the export supports, beside the installed one, for tests/interop: the pins of
# torchscale_fairseq/interop/transformers-floor.txt, --no-deps into $VENV/transformers-floor/ (only the
# tests' floor worker puts it on PYTHONPATH); redone whenever that list changes.
FLOOR_REQS="$ROOT/torchscale_fairseq/interop/transformers-floor.txt"
FLOOR_DIR="$VENV/transformers-floor"
if ! cmp -s "$FLOOR_REQS" "$FLOOR_DIR/requirements.txt"; then
  echo "[install] transformers floor copy: $FLOOR_DIR"
  rm -rf "$FLOOR_DIR" "$FLOOR_DIR.tmp"
  if "${PIP[@]}" install --no-deps --target "$FLOOR_DIR.tmp" -r "$FLOOR_REQS"; then
    cp "$FLOOR_REQS" "$FLOOR_DIR.tmp/requirements.txt" && mv "$FLOOR_DIR.tmp" "$FLOOR_DIR"
  else
    rm -rf "$FLOOR_DIR.tmp"
    echo "[install] warning: could not install $FLOOR_REQS; the floor half of tests/interop/test_hf_export.py will fail" >&2
  fi
fi
STAMP="$VENV/.torchscale_fairseq_installed"
# The checkout is part of the stamp: the editable install points at one checkout, and a venv reused
# from another (VENV=...) would import that one's code ("not globally unique" from --user-dir).
HASH="$( (cat "$ROOT/setup.py" "$ROOT/scripts/install.sh"; echo "$TORCH_SPEC ${NUMPY_SPEC:-} $ROOT") | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
  echo "[install] $VENV is up to date"
  exit 0
fi

"${PIP[@]}" install --upgrade "pip>=23" setuptools wheel
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" install "$TORCH_SPEC" ${TORCH_INDEX[@]+"${TORCH_INDEX[@]}"}
fi
# Keep that torch: fairseq asks for torchaudio, whose releases each pin one torch, so an
# unconstrained pip may replace the torch chosen above by another build or version. (The
# distribution's version: PyPI's 2.11.0 calls itself 2.11.0+cu130 in torch.__version__.)
TORCH_PIN="$VENV/torch-pin.txt"
"$VENV/bin/python" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > "$TORCH_PIN"
PIP_INSTALL=("${PIP[@]}" install -c "$TORCH_PIN")
# fairseq's extensions are built against NumPy 2 (such builds also run on NumPy 1.x), so a wheel
# pip caches here serves every numpy in the supported range.
"${PIP_INSTALL[@]}" "numpy>=2" cython "packaging"
FAIRSEQ="fairseq-fixed==0.12.3.1"
if ! "$VENV/bin/python" -c "import fairseq" 2>/dev/null; then
  echo "[install] $FAIRSEQ (no build isolation)"
  "${PIP_INSTALL[@]}" --no-build-isolation "$FAIRSEQ"
fi
# Offline assets: GPT-2 BPE ranks (openai-whisper ships them) and the gensim Wikipedia excerpt.
# Installed without dependencies: only their data files are used, found without importing them.
"${PIP_INSTALL[@]}" --no-deps "openai-whisper==20250625" "gensim==4.4.0"
# TorchScale (the ts-import-torchscale tests build its Decoder); without its pinned fairscale/timm,
# which would replace this torch (the tests stand in for the two functions it imports from them).
"${PIP_INSTALL[@]}" --no-deps "torchscale==0.3.0"
echo "[install] torchscale-fairseq (editable, with test, plots and export extras)"
"${PIP_INSTALL[@]}" --no-build-isolation -e "$ROOT[test,plots,export]"
# fairseq pulls in torchaudio, whose builds on the index do not load with this torch; only fairseq's
# speech code uses it, but transformers (export extra) imports it whenever it is installed.
if "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torchaudio') is None)" \
    && ! "$VENV/bin/python" -c "import torchaudio" 2>/dev/null; then
  echo "[install] removing torchaudio (does not load with this torch)"
  "${PIP[@]}" uninstall -y torchaudio
fi
if [ -n "${NUMPY_SPEC:-}" ]; then
  echo "[install] $NUMPY_SPEC"
  "${PIP_INSTALL[@]}" "$NUMPY_SPEC"
  # pip installs a numpy alone without revisiting what needs a newer one (on Python 3.12, scipy 1.18
  # and contourpy 1.4 need numpy>=2 and fail to import on 1.26): resolve those again beside it.
  numpy_conflicts() { "$VENV/bin/python" -m pip --disable-pip-version-check check 2>/dev/null | sed -nE 's/^([^ ]+) [^ ]+ has requirement numpy.*/\1/p'; }
  mapfile -t NEED_OTHER_NUMPY < <(numpy_conflicts)
  if [ "${#NEED_OTHER_NUMPY[@]}" -gt 0 ]; then
    echo "[install] $NUMPY_SPEC with ${NEED_OTHER_NUMPY[*]} (they required another numpy)"
    "${PIP_INSTALL[@]}" "$NUMPY_SPEC" "${NEED_OTHER_NUMPY[@]}"
  fi
  if [ -n "$(numpy_conflicts)" ]; then
    echo "[install] error: $NUMPY_SPEC conflicts with $(numpy_conflicts | paste -sd' ') (pip check): choose another NUMPY_SPEC" >&2
    exit 2
  fi
fi
if ! INSTALLED="$("$VENV/bin/python" -c 'import torch, fairseq; print("torch", torch.__version__, "fairseq", fairseq.__version__)')"; then
  echo "[install] error: torch or fairseq does not import in $VENV (traceback above): fix that package's version, or remove $VENV and rerun" >&2
  exit 1
fi
echo "$HASH" > "$STAMP"
echo "[install] done: $INSTALLED"
