#!/usr/bin/env bash
# Create (or reuse) .venv and install torchscale-fairseq with everything it needs, offline-friendly:
# torch CPU build first (never a CUDA build on a CPU machine), fairseq built without build isolation.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

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
STAMP="$VENV/.torchscale_fairseq_installed"
HASH="$(cat "$ROOT/setup.py" "$ROOT/scripts/install.sh" | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
  echo "[install] $VENV is up to date"
  exit 0
fi

"${PIP[@]}" install --upgrade "pip>=23" setuptools wheel
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[install] $TORCH_SPEC"
  "${PIP[@]}" install "$TORCH_SPEC"
fi
"${PIP[@]}" install "numpy<2.3" cython "packaging"
PYMINOR="$("$VENV/bin/python" -c 'import sys; print(sys.version_info[1])')"
if [ "$PYMINOR" -ge 11 ]; then FAIRSEQ="fairseq-fixed==0.12.3.1"; else FAIRSEQ="fairseq==0.12.2"; fi
if ! "$VENV/bin/python" -c "import fairseq" 2>/dev/null; then
  echo "[install] $FAIRSEQ (no build isolation)"
  "${PIP[@]}" install --no-build-isolation "$FAIRSEQ"
fi
# Offline assets: GPT-2 BPE ranks (openai-whisper ships them) and the gensim Wikipedia excerpt.
# Installed without dependencies: only their data files are used, found without importing them.
"${PIP[@]}" install --no-deps "openai-whisper==20250625" "gensim==4.4.0"
echo "[install] torchscale-fairseq (editable, with test and plots extras)"
"${PIP[@]}" install --no-build-isolation -e "$ROOT[test,plots]"
echo "$HASH" > "$STAMP"
echo "[install] done: $("$VENV/bin/python" -c 'import torch, fairseq; print("torch", torch.__version__, "fairseq", fairseq.__version__)')"
