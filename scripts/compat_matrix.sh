#!/usr/bin/env bash
# The compatibility matrix (README, "Supported versions"): {Python 3.11, 3.12, 3.13} x {torch 2.11,
# the newest torch}, each cell in its own venv (through install.sh) running the whole test suite,
# which runs the export tests against the newest and the floor transformers. `--newest`: the cell
# with everything at its newest release (the newest Python this machine has). The cells are
# scripts/compat_table.py's CELLS; each finished cell appends one JSON line to
# docs/compat/matrix.jsonl (date, commit, versions, passed / failed / errors, minutes), from which
# `python scripts/compat_table.py readme` regenerates the README's table.
#
#   bash scripts/compat_matrix.sh                    # the six cells of the grid, one after the other
#   bash scripts/compat_matrix.sh --newest           # everything at its newest release
#   bash scripts/compat_matrix.sh py313-torchnewest  # named cells only
#   TS_TEST_WORKERS=1 nice -n 10 bash scripts/compat_matrix.sh py313-torchnewest   # on a shared machine
#
# MATRIX_DIR (default /tmp/ts-compat-matrix) holds a venv, install.log and pytest.log per cell; a
# cell's venv is reused when its install is up to date. `newest` is resolved from the registry
# (`pip index versions`) when the cell runs. Each cell installs the CPU build where PyTorch's CPU
# index answers, else PyPI's CUDA wheel (about 3 GB with its CUDA libraries; it runs on the CPU).
# Python X.Y is `pythonX.Y` on PATH, else pyenv's. About 20-35 min per cell on 2 cores.
# TS_TEST_WORKERS: pytest-xdist workers as in scripts/test.sh (default 2; 0: one process).
# PYTEST_ARGS (default: tests) runs a part of the suite; a line is then recorded only with
# MATRIX_RECORD=1 (the file is for whole-suite runs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MATRIX_DIR="${MATRIX_DIR:-/tmp/ts-compat-matrix}"
WORKERS="${TS_TEST_WORKERS:-2}"
# Cells pin exact releases; a machine-wide pip constraint (PIP_CONSTRAINT or pip.conf's, e.g. one
# capping torch at the release a machine caches) would refuse them, so cells install without one.
export PIP_CONSTRAINT="${MATRIX_PIP_CONSTRAINT:-/dev/null}"

die() { echo "[compat_matrix] error: $*" >&2; exit 2; }
[[ "$WORKERS" =~ ^[0-9]+$ ]] || die "TS_TEST_WORKERS=$WORKERS: give a number of workers (0: no xdist)"

mapfile -t CELLS < <(python3 "$ROOT/scripts/compat_table.py" cells)
names() { printf '%s\n' "${CELLS[@]}" | cut -d'|' -f1; }

find_python() {  # X.Y, or "newest": the newest Python 3.11+ on PATH or in pyenv
  local version="$1" found candidates=()
  if [ "$version" = newest ]; then
    for found in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.*/bin/python3 $(compgen -c python3. | grep -xE 'python3\.[0-9]+' | sort -u); do
      found="$(command -v "$found" || true)"
      [ -n "$found" ] && "$found" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
        && candidates+=("$("$found" -c 'import sys; print("%d.%02d" % sys.version_info[:2])') $found")
    done
    [ "${#candidates[@]}" -gt 0 ] || die "no Python 3.11 or newer on PATH or in pyenv"
    printf '%s\n' "${candidates[@]}" | sort | tail -1 | cut -d' ' -f2
    return
  fi
  if found="$(command -v "python$version")" && "$found" -c '' 2>/dev/null; then echo "$found"; return; fi
  for found in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python3; do
    [ -x "$found" ] && { echo "$found"; return; }
  done
  die "no Python $version: install it (e.g. pyenv install $version) or put python$version on PATH"
}

newest_release() {  # PACKAGE PYTHON: the newest release the registry has for that interpreter
  local release
  release="$("$2" -m pip index versions "$1" 2>/dev/null | sed -nE "s/^$1 \(([^)]+)\)$/\1/p")"
  [ -n "$release" ] || die "could not ask the registry for $1's newest release (pip index versions $1)"
  echo "$release"
}

wanted=()
for arg in "$@"; do
  case "$arg" in
    --newest) wanted+=(newest) ;;
    -*) die "unknown option $arg: give --newest or cell names ($(names | paste -sd' '))" ;;
    *) names | grep -qx "$arg" || die "unknown cell $arg: choose from $(names | paste -sd' ')"; wanted+=("$arg") ;;
  esac
done
[ "${#wanted[@]}" -gt 0 ] || mapfile -t wanted < <(names | grep -vx newest)

mkdir -p "$MATRIX_DIR"
status=0
for cell in "${CELLS[@]}"; do
  IFS='|' read -r name pyver torch numpy <<<"$cell"
  printf '%s\n' "${wanted[@]}" | grep -qx "$name" || continue
  dir="$MATRIX_DIR/$name"
  mkdir -p "$dir"
  python="$(find_python "$pyver")"
  [ "$torch" = newest ] && torch="$(newest_release torch "$python")"
  numpy_spec=""
  [ "$numpy" = newest ] || numpy_spec="numpy==$numpy"
  echo "[compat_matrix] $name: installing ($python, torch==$torch, ${numpy_spec:-newest numpy}); log $dir/install.log"
  if ! VENV="$dir/venv" PYTHON="$python" TORCH_BUILD=cpu TORCH_SPEC="torch==$torch" NUMPY_SPEC="$numpy_spec" \
      bash "$ROOT/scripts/install.sh" >"$dir/install.log" 2>&1; then
    echo "[compat_matrix] $name: install FAILED ($dir/install.log); no line recorded" >&2
    status=1
    continue
  fi
  "$dir/venv/bin/python" -m compileall -q -j 0 "$ROOT/torchscale_fairseq" "$ROOT/tests" >/dev/null || true
  pytest_args=(${PYTEST_ARGS:-tests})
  [ "$WORKERS" = 0 ] || pytest_args+=(-n "$WORKERS" --dist loadfile)
  echo "[compat_matrix] $name: pytest ${pytest_args[*]}; log $dir/pytest.log"
  start=$(date +%s)
  started="$(python3 "$ROOT/scripts/compat_table.py" state)"  # the line names this tree, not the one at the end
  if (cd "$ROOT" && "$dir/venv/bin/python" -m pytest -p no:cacheprovider "${pytest_args[@]}") >"$dir/pytest.log" 2>&1; then
    result=passed
  else
    result=FAILED
    status=1
  fi
  minutes="$(( $(date +%s) - start ))"
  minutes="$(python3 -c "print($minutes / 60)")"
  echo "[compat_matrix] $name: $result ($(grep -E ' in [0-9.]+s' "$dir/pytest.log" | tail -1))"
  if [ -z "${PYTEST_ARGS:-}" ] || [ "${MATRIX_RECORD:-0}" = 1 ]; then
    python3 "$ROOT/scripts/compat_table.py" record "$name" "$dir/venv" "$dir/pytest.log" "$minutes" "$WORKERS" "$started"
    # at once: the next cell's suite checks that the README's table equals the file
    python3 "$ROOT/scripts/compat_table.py" readme
  fi
done
exit "$status"
