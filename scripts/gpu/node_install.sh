#!/usr/bin/env bash
# Install step of scripts/gpu/run_gpu_check.sh, ON the offline node: a virtualenv at $GPU_VENV that
# sees the node python's own packages (torch), then the wheelhouse with no index and no
# dependency resolution (--no-deps: every file the node lacks is named in the wheelhouse's lists),
# fairseq-fixed (the prebuilt wheel where it was built against this torch, else from source), this
# package (editable), and an import check. Prints one `INSTALL ...` line with the time of each part.
#   PYTHON=python3 GPU_VENV=/tmp/ts_gpu_venv WHEELHOUSE=scripts/gpu/wheelhouse bash scripts/gpu/node_install.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WH="${WHEELHOUSE:-$ROOT/scripts/gpu/wheelhouse}"
PY="${PYTHON:-python3}"
VENV="${GPU_VENV:-/tmp/ts_gpu_venv}"
VPY="$VENV/bin/python"
BUILT="${GPU_CHECK_BUILT_WHEELS:-}"   # where a fairseq wheel compiled here is kept (run_gpu_check.sh: results dir)
PARTS=()
T0=$SECONDS
part() { PARTS+=("$1 $((SECONDS - T0))s"); T0=$SECONDS; echo "[install] $1 done"; }

# pip sees only the wheelhouse: no index, no configuration file, no PIP_* variables of this machine
for v in $(compgen -e | grep '^PIP_' || true); do unset "$v"; done
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
PIP=("$VPY" -m pip install --no-index --no-deps --no-cache-dir --no-compile --find-links "$WH")  # bytecode: on first import

# 1. The venv. The node's python3 may itself be a virtualenv (/opt/torch/.venv) and may lack
# ensurepip: the venv gets no pip of its own, and a .pth file adds the node python's site
# directories (with their own .pth files), so the node's torch and pip serve it.
"$PY" -m venv --without-pip --clear "$VENV"
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PY" -c 'import sys
dirs = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
print("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs))' > "$SITE/ts_node_site_packages.pth"
"$VPY" -c 'import pip, torch; print("venv sees torch", torch.__version__, "and pip", pip.__version__)'
part venv

# 2. Core wheels (always), fallback wheels where the node has no version of the distribution.
"${PIP[@]}" -r "$WH/core.txt"
MISSING="$("$VPY" - "$WH/fallback.txt" <<'PY'
import importlib.metadata as md
import sys

for spec in open(sys.argv[1]).read().split():
    try:
        md.version(spec.split("==")[0])
    except md.PackageNotFoundError:
        print(spec)
PY
)"
if [ -n "$MISSING" ]; then
  echo "[install] the node lacks: $(echo $MISSING): installing them from the wheelhouse"
  # shellcheck disable=SC2086
  "${PIP[@]}" $MISSING
fi
part "wheels(core$([ -n "$MISSING" ] && echo "+$(echo "$MISSING" | wc -l) fallback"))"

# 3. fairseq-fixed: the prebuilt wheel when its build record (python, torch, C++ ABI) is this node's,
# else compiled here from source against this torch (CPU extensions only: CUDA_HOME unset).
NODE_RECORD="$("$VPY" -c 'import sys, torch
print(f"python={sys.version_info[0]}.{sys.version_info[1]} torch={torch.__version__} cxx11abi={int(torch.compiled_with_cxx11_abi())}")')"
EXTENSIONS='import fairseq.libbase, fairseq.libnat, fairseq.libbleu, fairseq.data.data_utils_fast, fairseq.data.token_block_utils_fast'
how=""
# candidates: the wheelhouse's prebuilt wheel, then one an earlier run compiled on such a node (its
# results, carried along with them)
for rec in "$WH/fairseq-wheel.txt" ${BUILT:+"$BUILT/fairseq-wheel.txt"}; do
  [ -f "$rec" ] || continue
  read -r WHEEL RECORD < "$rec"
  # the record's torch, python and ABI must be the node's (numpy: any 2.x, the ABI fairseq's Cython uses)
  want="$(echo "$RECORD" | tr ' ' '\n' | grep -v '^numpy=' | tr '\n' ' ' | sed 's/ $//')"
  if [ "$want" = "$NODE_RECORD" ] && [ -f "$(dirname "$rec")/$WHEEL" ]; then
    "${PIP[@]}" --force-reinstall "$(dirname "$rec")/$WHEEL"
    if "$VPY" -c "$EXTENSIONS" 2>&1; then
      how="prebuilt wheel"; [ "$rec" = "$WH/fairseq-wheel.txt" ] || how="wheel compiled by an earlier run"
      echo "[install] fairseq: $WHEEL ($RECORD) from $(dirname "$rec")"; break
    fi
    echo "[install] the extensions of $WHEEL do not load here"
  else
    echo "[install] $rec is a fairseq wheel for '$want', this node is '$NODE_RECORD'"
  fi
done
if [ -z "$how" ]; then
  SDIST="$(ls "$WH"/fairseq_fixed-*.tar.gz | head -n 1)"
  TMPW="$(mktemp -d)"
  env -u CUDA_HOME MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$VPY" -m pip wheel --no-index --no-deps --no-cache-dir \
    --no-build-isolation -w "$TMPW" "$SDIST"
  "${PIP[@]}" --force-reinstall "$TMPW"/fairseq_fixed-*.whl
  if [ -n "$BUILT" ]; then  # kept with the results (they come back, and a later install takes it)
    mkdir -p "$BUILT"
    if command -v strip >/dev/null 2>&1 && "$VPY" -m wheel version >/dev/null 2>&1; then
      mkdir "$TMPW/x"  # without the extensions' debug information: 12 MiB instead of 21
      "$VPY" -m wheel unpack -d "$TMPW/x" "$TMPW"/fairseq_fixed-*.whl >/dev/null
      find "$TMPW/x" -name '*.so' -exec strip --strip-debug {} +
      "$VPY" -m wheel pack -d "$BUILT" "$TMPW"/x/fairseq_fixed-* >/dev/null
    else
      cp "$TMPW"/fairseq_fixed-*.whl "$BUILT/"
    fi
    echo "$(basename "$(ls "$TMPW"/fairseq_fixed-*.whl)") $NODE_RECORD" > "$BUILT/fairseq-wheel.txt"
    echo "[install] the wheel compiled here is kept in $BUILT, with fairseq-wheel.txt"
  fi
  rm -rf "$TMPW"
  how="built from source"
fi
part "fairseq($how)"

# 4. This package, editable (its console scripts in the venv), nothing else.
"${PIP[@]}" --no-build-isolation --use-pep517 -e "$ROOT"   # PEP 660: a pip < 25.3 would otherwise run setup.py develop, which a setuptools >= 80 hands to an isolated pip (network)
part torchscale-fairseq

# 5. What the check imports, with the versions it runs on.
"$VPY" - <<PY
import importlib.metadata as md

import bitarray, fairseq, hydra, omegaconf, sacrebleu, sentencepiece, tiktoken, torch  # noqa: F401
$EXTENSIONS
import torchscale_fairseq  # noqa: F401  (registers the plugin)
import torchscale_fairseq.data.gpt2_bpe as bpe

assert bpe.get_gpt2_encoding().n_vocab == 50257
print("imports ok:", ", ".join(f"{n} {md.version(n)}" for n in (
    "torch", "numpy", "fairseq-fixed", "hydra-core", "omegaconf", "sacrebleu", "tiktoken", "sentencepiece")))
PY
part imports
echo "INSTALL ok: ${PARTS[*]}"
