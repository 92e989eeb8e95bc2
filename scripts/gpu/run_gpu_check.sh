#!/usr/bin/env bash
# Run ON the offline GPU node, in the repository root, with scripts/gpu/wheelhouse/ (made by
# prepare_offline.sh) copied along: installs the wheelhouse into a temporary virtualenv that sees the
# node's own torch (--system-site-packages, no index, no network), builds fairseq-fixed against that
# torch, installs this package, runs `pytest -m gpu tests/gpu` and the GPU benchmarks, and writes logs
# and summary.md into $OUT (else outputs/gpu/). Everything within GPU_CHECK_BUDGET seconds (570).
#   bash scripts/gpu/run_gpu_check.sh             # on the node
#   bash scripts/gpu/run_gpu_check.sh --dry-run   # anywhere: print every step, check the wheelhouse
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WH="${WHEELHOUSE:-$ROOT/scripts/gpu/wheelhouse}"
OUT_DIR="${OUT:-$ROOT/outputs/gpu}"
PY="${PYTHON:-python3}"                     # the node's Python with its CUDA torch
VENV="${GPU_VENV:-/tmp/ts_gpu_venv}"
BUDGET="${GPU_CHECK_BUDGET:-570}"
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
START=$SECONDS
ROWS=()
FAILED=0

say() { echo "[gpu-check $((SECONDS - START))s] $*"; }
left() { echo $((BUDGET - (SECONDS - START))); }

wanted() { [ -z "${GPU_CHECK_ONLY:-}" ] || [[ " $GPU_CHECK_ONLY " == *" $1 "* ]]; }

# step NAME LOG LIMIT_S CMD...: run CMD (output appended to $OUT_DIR/LOG) under `timeout`, at most
# LIMIT_S seconds and never past the budget; one summary row per step. --dry-run prints it only.
step() {
  local name="$1" log="$2" limit="$3"; shift 3
  local remaining; remaining="$(left)"
  if ! wanted "$name"; then return 0; fi
  if [ "$DRY" = 1 ]; then
    say "would run ($name, <= ${limit}s, log $log): $*"
    ROWS+=("| $name | dry run | - | \`${*//|//}\` |")
    return 0
  fi
  if [ "$remaining" -lt 20 ]; then
    say "$name: skipped, budget spent"
    ROWS+=("| $name | SKIPPED (budget spent) | 0 | - |")
    FAILED=1
    return 1
  fi
  [ "$limit" -gt "$remaining" ] && limit="$remaining"
  say "$name (<= ${limit}s): $*"
  touch "$OUT_DIR/$log"
  local t0=$SECONDS first rc
  first=$(( $(wc -l < "$OUT_DIR/$log") + 1 ))
  echo "### $name: $*" >> "$OUT_DIR/$log"
  timeout --kill-after=10 "$limit" "$@" >> "$OUT_DIR/$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0)) status="ok" result
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status="TIMEOUT after ${limit}s"; FAILED=1
  elif [ "$rc" != 0 ]; then status="FAILED (exit $rc)"; FAILED=1; fi
  # the benchmarks' RESULT lines and pytest's final count, else the last line
  result="$(tail -n +"$first" "$OUT_DIR/$log" | grep -E '^RESULT|^== |[0-9]+ (passed|failed|error)' | tail -n 6 \
            | tr '\n' ' ')"
  [ -n "$result" ] || result="$(tail -n 1 "$OUT_DIR/$log" | cut -c1-200)"
  ROWS+=("| $name | $status | $took | ${result//|//} |")
  say "$name: $status in ${took}s"
  [ "$status" = ok ]
}

check_wheelhouse() {
  local missing=0 spec name version file
  for list in requirements.txt no-deps.txt fairseq.txt SHA256SUMS; do
    [ -f "$WH/$list" ] || { echo "missing $WH/$list: run scripts/gpu/prepare_offline.sh first"; return 1; }
  done
  while read -r spec; do
    [ -n "$spec" ] || continue
    name="${spec%%==*}"; version="${spec##*==}"
    name="$(echo "$name" | tr 'A-Z-' 'a-z_')"
    file="$(ls "$WH" | tr 'A-Z' 'a-z' | grep -E "^${name}-${version}(-|\.tar\.gz)" | head -n 1)"
    if [ -z "$file" ]; then echo "missing in wheelhouse: $spec"; missing=1; fi
  done < <(cat "$WH/requirements.txt" "$WH/no-deps.txt" "$WH/fairseq.txt")
  (cd "$WH" && sha256sum --quiet -c SHA256SUMS) || { echo "wheelhouse checksums differ"; missing=1; }
  [ "$missing" = 0 ] && echo "wheelhouse complete: $(ls "$WH" | wc -l) files, $(du -sh "$WH" | cut -f1)"
  return "$missing"
}

mkdir -p "$OUT_DIR"
say "repository $ROOT, wheelhouse $WH, output $OUT_DIR, venv $VENV, budget ${BUDGET}s$([ "$DRY" = 1 ] && echo ', DRY RUN')"
if ! check_wheelhouse; then
  echo "[gpu-check] error: the wheelhouse is incomplete (see above)" >&2
  exit 2
fi
"$PY" - <<'PY' || { [ "$DRY" = 1 ] || { echo "[gpu-check] error: no usable torch in $PY" >&2; exit 2; }; }
import sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"CUDA available {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
PY
if [ "$DRY" = 0 ] && command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; fi

VPY="$VENV/bin/python"
# The node's python3 may itself be a virtualenv (/opt/torch/.venv): a venv made from it sees only the
# base interpreter's site-packages, so its own site-packages (torch) are added with a .pth file.
make_venv() {
  "$PY" -m venv --system-site-packages --clear "$VENV" || return 1
  local site; site="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
  "$PY" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' \
    > "$site/ts_node_site_packages.pth" || return 1
  "$VPY" -c 'import torch; print("venv sees torch", torch.__version__, "from", torch.__file__)'
}
export -f make_venv
export PY VENV VPY
PIP=("$VPY" -m pip --disable-pip-version-check --no-input --no-cache-dir install --no-index --find-links "$WH")
FAIRSEQ_SDIST="$(ls "$WH"/fairseq_fixed-*.tar.gz 2>/dev/null | head -n 1)"
# A second run on the same (still warm) machine reuses the environment of the first.
STAMP="$VENV/.ts_gpu_check_installed"
HASH="$(cat "$WH/SHA256SUMS" "$ROOT/setup.py" | sha256sum | cut -c1-16)"
if [ "$DRY" = 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
  say "$VENV is up to date: installation skipped"
else
  {
    step venv install.log 60 bash -c make_venv &&
    step wheels install.log 90 "${PIP[@]}" -r "$WH/requirements.txt" &&
    step whisper-assets install.log 30 "${PIP[@]}" --no-deps -r "$WH/no-deps.txt" &&
    step fairseq-build install.log 300 env -u CUDA_HOME MAX_JOBS=16 "${PIP[@]}" --no-build-isolation "$FAIRSEQ_SDIST" &&
    step torchscale-fairseq install.log 60 "${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT" &&
    step import-check install.log 60 "$VPY" -c "import fairseq, torch, torchscale_fairseq.data.gpt2_bpe as bpe; \
assert bpe.get_gpt2_encoding().n_vocab == 50257; print('fairseq', fairseq.__version__, 'torch', torch.__version__)" &&
    { [ "$DRY" = 1 ] || echo "$HASH" > "$STAMP"; }
  } || say "installation failed: tests and benchmarks not run (see $OUT_DIR/install.log)"
fi

if [ "$DRY" = 1 ] || [ "$FAILED" = 0 ]; then
  cd "$ROOT" || exit 2
  export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
  step pytest-gpu pytest.log 240 "$VPY" -m pytest -m gpu tests/gpu -p no:cacheprovider -o addopts="-ra" \
    --durations=10 -q
  # most important first: what does not fit in the budget is reported as skipped (run it again
  # with GPU_CHECK_ONLY="bench-throughput bench-generation" on the same warm machine)
  step bench-mfu bench_mfu.log 120 "$VPY" benchmarks/gpu_mfu.py
  step bench-moe bench_moe.log 45 "$VPY" benchmarks/moe_layer.py --device cuda --dtype bf16 --repeats 12
  step bench-throughput bench_throughput.log 150 "$VPY" benchmarks/gpu_throughput.py --rounds 1
  step bench-generation bench_generation.log 75 "$VPY" benchmarks/gpu_generation.py --rounds 1
fi

{
  echo "# GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'))"
  echo
  "$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA', '| torch', torch.__version__, '| CUDA', torch.version.cuda)" 2>/dev/null || echo "device: unknown (no torch)"
  command -v nvidia-smi >/dev/null 2>&1 && [ "$DRY" = 0 ] && echo "driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader)"
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'); total $((SECONDS - START)) s of ${BUDGET} s"
  echo
  echo "| step | status | seconds | result (last lines) |"
  echo "|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
} > "$OUT_DIR/summary.md"
cat "$OUT_DIR/summary.md"
[ "$DRY" = 1 ] && exit 0
exit "$FAILED"
