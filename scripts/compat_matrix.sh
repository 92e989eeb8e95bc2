#!/usr/bin/env bash
# The ends of the supported version ranges (setup.py; README, "Supported versions"), each in its
# own venv, each running the whole test suite (which runs the export tests against both the
# floor and the newest transformers). Prints a Markdown table: what ran, what passed, when.
#
#   bash scripts/compat_matrix.sh                 # every cell below, one after the other
#   bash scripts/compat_matrix.sh py312-torch211  # named cells only
#   MATRIX_DIR=/tmp/m PYTEST_ARGS="tests/interop" bash scripts/compat_matrix.sh   # a part of the suite
#
# MATRIX_DIR (default /tmp/ts-compat-matrix) holds a venv, install.log and pytest.log per cell and
# results.md; a cell's venv is reused when its install is up to date. Each cell installs the CPU
# build where PyTorch's CPU index answers, else PyPI's CUDA wheel (about 3 GB; it runs on the CPU).
# Python X.Y is `pythonX.Y` on PATH, else pyenv's. About 20 min per cell on 2 cores.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MATRIX_DIR="${MATRIX_DIR:-/tmp/ts-compat-matrix}"

# name | python | torch | numpy: the floors, the GPU node's stack, the newest releases
CELLS=(
  "py311-torch211|3.11|torch==2.11.0|numpy==1.26.4"
  "py311-torch2141|3.11|torch==2.14.1|numpy==2.4.6"
  "py312-torch211|3.12|torch==2.11.0|numpy==2.5.2"
  "py312-torch2141|3.12|torch==2.14.1|numpy==2.5.5"
)

die() { echo "[compat_matrix] error: $*" >&2; exit 2; }

find_python() {
  local version="$1" found
  if found="$(command -v "python$version")" && "$found" -c '' 2>/dev/null; then echo "$found"; return; fi
  for found in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python3; do
    [ -x "$found" ] && { echo "$found"; return; }
  done
  die "no Python $version: install it (e.g. pyenv install $version) or put python$version on PATH"
}

wanted=("$@")
for name in "${wanted[@]}"; do
  printf '%s\n' "${CELLS[@]}" | cut -d'|' -f1 | grep -qx "$name" \
    || die "unknown cell $name: choose from $(printf '%s\n' "${CELLS[@]}" | cut -d'|' -f1 | tr '\n' ' ')"
done

mkdir -p "$MATRIX_DIR"
RESULTS="$MATRIX_DIR/results.md"
[ -f "$RESULTS" ] || {
  echo "| cell | versions | result | pytest | date (UTC), commit |"
  echo "|---|---|---|---|---|"
} > "$RESULTS"
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
status=0
for cell in "${CELLS[@]}"; do
  IFS='|' read -r name pyver torch_spec numpy_spec <<<"$cell"
  if [ "${#wanted[@]}" -gt 0 ] && ! printf '%s\n' "${wanted[@]}" | grep -qx "$name"; then continue; fi
  dir="$MATRIX_DIR/$name"
  mkdir -p "$dir"
  python="$(find_python "$pyver")"
  echo "[compat_matrix] $name: installing ($python, $torch_spec, $numpy_spec); log $dir/install.log"
  if ! VENV="$dir/venv" PYTHON="$python" TORCH_BUILD=cpu TORCH_SPEC="$torch_spec" NUMPY_SPEC="$numpy_spec" \
      bash "$ROOT/scripts/install.sh" >"$dir/install.log" 2>&1; then
    echo "| $name | Python $pyver, $torch_spec, $numpy_spec | install FAILED ($dir/install.log) | | $(date -u +%F\ %H:%M), $COMMIT |" >>"$RESULTS"
    status=1
    continue
  fi
  versions="$(cd "$ROOT" && "$dir/venv/bin/python" -c 'from tests.conftest import installed_versions as v; print(v())')"
  echo "[compat_matrix] $name: $versions; pytest log $dir/pytest.log"
  start=$(date +%s)
  # shellcheck disable=SC2086  # PYTEST_ARGS is split into words on purpose
  if (cd "$ROOT" && "$dir/venv/bin/python" -m pytest -p no:cacheprovider ${PYTEST_ARGS:-tests}) >"$dir/pytest.log" 2>&1; then
    result="passed"
  else
    result="FAILED"
    status=1
  fi
  minutes=$(( ($(date +%s) - start + 30) / 60 ))
  summary="$(grep -E '(passed|failed|error).* in [0-9.]+s' "$dir/pytest.log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')"
  echo "| $name | $versions | $result: $summary | $minutes min | $(date -u +%F\ %H:%M), $COMMIT |" >>"$RESULTS"
  echo "[compat_matrix] $name: $result ($summary)"
done
cat "$RESULTS"
exit "$status"
