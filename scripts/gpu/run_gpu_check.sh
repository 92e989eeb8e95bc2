#!/usr/bin/env bash
# Run ON the offline GPU node, in the repository root, with scripts/gpu/wheelhouse/ (made by
# prepare_offline.sh) copied along. The check is split into stages that each fit one device call
# (10 minutes) and together 25 minutes; each stage installs what it needs (scripts/gpu/node_install.sh,
# skipped when the venv of an earlier stage on the same machine is still there) and writes its results,
# step by step, to the results folder (GPU_CHECK_RESULTS, else outputs/gpu/) and to $OUT when set:
# stageN.md (one row per step), check.log (every step's output) and summary.md, plus a fairseq wheel
# compiled on the node, if one was. A later run reads them back (from the same warm machine, or
# carried to a fresh one) and goes on with what is not done yet. scripts/gpu/README.md.
#   bash scripts/gpu/run_gpu_check.sh               # the next stage with steps not done (resume)
#   bash scripts/gpu/run_gpu_check.sh --stage 2     # stage 2, every step again
#   bash scripts/gpu/run_gpu_check.sh --stage all   # every stage not done, one after another
#   bash scripts/gpu/run_gpu_check.sh --next        # print the next stage (or "none") and stop
#   bash scripts/gpu/run_gpu_check.sh --plan        # the stages, their limits and expected times, checked
#   bash scripts/gpu/run_gpu_check.sh --dry-run     # the wheelhouse checked, the next stage's commands printed
#   GPU_CHECK_ONLY="pytest-gpu bench-moe" bash scripts/gpu/run_gpu_check.sh --stage all
#                                                   # only the steps named (and the install), run again
#                                                   # whatever was recorded: a shorter lease
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WH="${WHEELHOUSE:-$ROOT/scripts/gpu/wheelhouse}"
RESULTS="${GPU_CHECK_RESULTS:-$ROOT/outputs/gpu}"
OUT_DIR="${OUT:-}"                          # the device tool's folder that comes back (8 files at most: 8 here)
PY="${PYTHON:-python3}"                     # the node's Python with its CUDA torch
VENV="${GPU_VENV:-/tmp/ts_gpu_venv}"
VPY="$VENV/bin/python"
CALL_LIMIT=570        # one device call is 10 minutes: a stage, its start and its summary must fit
TOTAL_LIMIT=1500      # all stages: 25 minutes, more than one 15-minute lease (scripts/gpu/README.md)
STAGE_LIMIT=(0 480 460 560)                 # seconds per stage (index = stage)
SLOWDOWN="${GPU_CHECK_SLOWDOWN:-1}"         # multiplies every limit (a slow CPU stand-in; 1 on the node)
ONLY="${GPU_CHECK_ONLY:-}"                  # step names: run only these (the others stay as recorded)
PYTEST=(-p no:cacheprovider -o addopts= -ra -q --durations=10)

# The plan: stage | step | limit (s) | expected on the node (s, an estimate until measured) | without
# CUDA ("-": runs anyway; "pytest": runs, and pytest's "deselected: no CUDA" is the result; else the
# CPU toy command run with GPU_CHECK_TOY=1) | command. $VPY is the venv's python, $XDIST pytest-xdist's
# flags where the node has it. Expected times: see scripts/gpu/README.md.
plan() {
  cat <<'PLAN'
1|install|420|40|-|bash scripts/gpu/node_install.sh
1|cpu-smoke|150|40|-|$VPY -m pytest tests/test_device_init.py tests/optim/test_mixed_precision.py $PYTEST_FLAGS
1|pytest-gpu|300|230|pytest|$VPY -m pytest -m gpu tests/gpu --ignore=tests/gpu/test_cuda_training.py $PYTEST_FLAGS $XDIST
1|bench-moe|150|80|$VPY benchmarks/moe_layer.py --tokens 512 --dim 32 --ffn 64 --experts 4 8 --repeats 2 --dtype bf16 --expert-gemm grouped --compiled-routing both --compiled-experts both|$VPY benchmarks/moe_layer.py --device cuda --dtype bf16 --repeats 12 --expert-gemm grouped --compiled-routing both --compiled-experts both --results $GPU_CHECK_BUILT_WHEELS/gpu_results.jsonl
1|bench-moe-compile|150|80|$VPY benchmarks/moe_layer.py --tokens 512 --dim 32 --ffn 64 --experts 4 8 --repeats 2 --dtype bf16 --expert-gemm grouped --compile aot_eager --kernel-profile|$VPY benchmarks/moe_layer.py --device cuda --dtype bf16 --repeats 12 --expert-gemm grouped --compile inductor --cuda-graphs both --kernel-profile --results $GPU_CHECK_BUILT_WHEELS/gpu_results.jsonl
2|install|420|40|-|bash scripts/gpu/node_install.sh
2|pytest-gpu-training|360|200|pytest|$VPY -m pytest -m gpu tests/gpu/test_cuda_training.py $PYTEST_FLAGS
2|bench-generation|150|75|$VPY benchmarks/gpu_generation.py --toy|$VPY benchmarks/gpu_generation.py --rounds 1
3|install|420|40|-|bash scripts/gpu/node_install.sh
3|bench-speed|520|520|$VPY benchmarks/gpu_speed.py --toy --results $GPU_CHECK_BUILT_WHEELS/gpu_results.jsonl|$VPY benchmarks/gpu_speed.py --results $GPU_CHECK_BUILT_WHEELS/gpu_results.jsonl
PLAN
}
STAGES=(1 2 3)

MODE=next
STAGE_ARG=""
case "${1:-}" in
  "") ;;
  --stage) STAGE_ARG="${2:-}"; MODE=stage
    [[ "$STAGE_ARG" =~ ^(1|2|3|all)$ ]] || { echo "usage: $0 --stage 1|2|3|all" >&2; exit 2; } ;;
  --next) MODE=print-next ;;
  --plan) MODE=plan ;;
  --dry-run) MODE=dry ;;
  *) echo "usage: $0 [--stage 1|2|3|all | --next | --plan | --dry-run]" >&2; exit 2 ;;
esac

# --- the plan's time check: every stage within one call, its expected sum within its limit, all
# stages within the total; GPU_CHECK_EXPECTED="step=seconds ..." overrides estimates (measured times)
expected_of() {
  local step="$1" default="$2" pair
  for pair in ${GPU_CHECK_EXPECTED:-}; do
    [ "${pair%%=*}" = "$step" ] && { echo "${pair#*=}"; return; }
  done
  echo "$default"
}
check_plan() {
  local bad=0 total=0 stage sum lim line s name limit exp
  for stage in "${STAGES[@]}"; do
    lim="${STAGE_LIMIT[$stage]}"; sum=0
    total=$((total + lim))
    [ "$lim" -le "$CALL_LIMIT" ] || { echo "plan error: stage $stage limit ${lim}s exceeds one call (${CALL_LIMIT}s): move a step to another stage"; bad=1; }
    while IFS='|' read -r s name limit exp _; do
      [ "$s" = "$stage" ] || continue
      exp="$(expected_of "$name" "$exp")"
      sum=$((sum + exp))
      [ "$limit" -le "$lim" ] || { echo "plan error: step $name limit ${limit}s exceeds stage $stage's ${lim}s: lower it"; bad=1; }
    done < <(plan)
    printf 'stage %s: limit %4ss, expected %4ss\n' "$stage" "$lim" "$sum"
    [ "$sum" -le "$lim" ] || { echo "plan error: stage $stage expects ${sum}s, over its ${lim}s limit: move a step to another stage"; bad=1; }
  done
  printf 'all stages: limit %4ss (at most %ss)\n' "$total" "$TOTAL_LIMIT"
  [ "$total" -le "$TOTAL_LIMIT" ] || { echo "plan error: the stages' limits add up to ${total}s, over ${TOTAL_LIMIT}s: shorten a stage"; bad=1; }
  return "$bad"
}

# --- results: stageN.md rows "| step | status | seconds | result |"
CUDA=0
cuda_now() { "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
status_of() {  # status_of STAGE STEP -> the recorded status, or nothing
  local md="$RESULTS/stage$1.md"
  [ -f "$md" ] || return 0
  grep -E "^\| $2 \|" "$md" | tail -n 1 | awk -F'|' '{gsub(/^ +| +$/, "", $3); print $3}'
}
is_done() {  # a step ran (ok, failed or timed out), or reported no CUDA on a machine that still has none
  local st; st="$(status_of "$1" "$2")"
  case "$st" in
    ok*|FAILED*|TIMEOUT*) return 0 ;;
    "no CUDA"*) [ "$CUDA" = 0 ] ;;
    *) return 1 ;;
  esac
}
steps_of() { plan | awk -F'|' -v s="$1" '$1 == s {print $2}'; }
stage_done() {
  local step
  for step in $(steps_of "$1"); do
    [ "$step" = install ] && continue
    is_done "$1" "$step" || return 1
  done
  return 0
}
next_stage() {
  local stage
  for stage in "${STAGES[@]}"; do stage_done "$stage" || { echo "$stage"; return; }; done
  echo none
}

mirror() {  # copy the results to $OUT (it comes back from the device machine)
  [ -n "$OUT_DIR" ] && [ "$(cd "$OUT_DIR" 2>/dev/null && pwd)" != "$(cd "$RESULTS" && pwd)" ] || return 0
  mkdir -p "$OUT_DIR"
  cp "$RESULTS"/stage*.md "$RESULTS"/check.log "$RESULTS"/summary.md "$RESULTS"/fairseq_fixed-*.whl \
     "$RESULTS"/fairseq-wheel.txt "$RESULTS"/gpu_results.jsonl "$OUT_DIR"/ 2>/dev/null || true
}

device_line() {
  "$PY" - <<'PY' 2>/dev/null || echo "device: unknown (no torch in the node python)"
import os, platform, sys
import torch
cuda = torch.cuda.is_available()
print(f"device: {torch.cuda.get_device_name(0) if cuda else 'no CUDA'} | python {sys.version.split()[0]} | torch "
      f"{torch.__version__} (CUDA build {torch.version.cuda}) | host {platform.node()}, {os.cpu_count()} CPUs")
PY
  if [ "$CUDA" = 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
    echo "driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
  fi
}

declare -A ROW
write_stage() {  # write_stage STAGE: stageN.md from the rows recorded, in plan order
  local stage="$1" step md="$RESULTS/stage$1.md"
  {
    echo "# GPU check, stage $stage ($(date -u '+%Y-%m-%d %H:%M UTC'))"
    echo
    echo "$DEVICE"
    echo "commit: ${TS_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (modified)')}; stage limit ${STAGE_LIMIT[$stage]} s x slowdown $SLOWDOWN"
    echo
    echo "| step | status | seconds | result |"
    echo "|---|---|---|---|"
    for step in $(steps_of "$stage"); do
      if [ -n "${ROW[$stage/$step]:-}" ]; then echo "${ROW[$stage/$step]}"
      elif grep -qE "^\| $step \|" "$md.old" 2>/dev/null; then grep -E "^\| $step \|" "$md.old" | tail -n 1
      else echo "| $step | not run yet | - | - |"; fi
    done
  } > "$md.new"
  mv "$md.new" "$md"
  write_summary
}
write_summary() {
  local stage
  {
    echo "# GPU check: summary ($(date -u '+%Y-%m-%d %H:%M UTC'))"
    echo
    echo "next stage: $(next_stage) (\`bash scripts/gpu/run_gpu_check.sh\` goes on from there)"
    for stage in "${STAGES[@]}"; do
      echo
      if [ -f "$RESULTS/stage$stage.md" ]; then sed -n '3,$p' "$RESULTS/stage$stage.md" | sed "1s/^/stage $stage: /"
      else echo "stage $stage: not run yet"; fi
    done
  } > "$RESULTS/summary.md"
  mirror
}

# run_step STAGE STEP LIMIT NOCUDA CMD: one step under `timeout` within the stage's budget
run_step() {
  local stage="$1" step="$2" limit="$3" nocuda="$4" cmd="$5" log="$RESULTS/check.log"
  local remaining=$((BUDGET - (SECONDS - STAGE_START))) status result rc took t0 first
  limit=$((limit * SLOWDOWN))
  if [ "$DRY" = 1 ]; then
    echo "[gpu-check] stage $stage would run $step (<= ${limit}s): $cmd"
    return 0
  fi
  if [ "$remaining" -lt 20 ]; then
    ROW[$stage/$step]="| $step | SKIPPED (stage budget spent) | 0 | run the check again: it goes on here |"
    echo "[gpu-check] $step: skipped, the stage's budget is spent (a later run goes on here)"
    write_stage "$stage"; return 0
  fi
  [ "$limit" -gt "$remaining" ] && limit="$remaining"
  if [ "$CUDA" = 0 ] && [ "$nocuda" != "-" ] && [ "$nocuda" != pytest ]; then  # a GPU benchmark
    if [ "${GPU_CHECK_TOY:-0}" != 1 ]; then
      ROW[$stage/$step]="| $step | no CUDA | 0 | needs a GPU: not run (GPU_CHECK_TOY=1 runs its CPU toy size) |"
      echo "[gpu-check] $step: no CUDA, not run"
      write_stage "$stage"; return 0
    fi
    cmd="$nocuda"
  fi
  echo "[gpu-check $((SECONDS - STAGE_START))s] stage $stage, $step (<= ${limit}s): $cmd"
  touch "$log"
  first=$(( $(wc -l < "$log") + 1 ))
  echo "### stage $stage, $step ($(date -u '+%Y-%m-%d %H:%M:%S UTC')): $cmd" >> "$log"
  t0=$SECONDS
  (cd "$ROOT" && PYTHON="$PY" GPU_VENV="$VENV" WHEELHOUSE="$WH" VPY="$VPY" PYTEST_FLAGS="${PYTEST[*]}" XDIST="$XDIST" GPU_CHECK_BUILT_WHEELS="$RESULTS" \
     PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore timeout --kill-after=10 "$limit" bash -c "exec $cmd") >> "$log" 2>&1
  rc=$?
  took=$((SECONDS - t0))
  result="$(tail -n +"$first" "$log" | grep -E '^RESULT|^INSTALL|deselected: no CUDA|[0-9]+ (passed|failed|error|deselected)' \
            | tail -n 4 | tr '\n' ' ' | cut -c1-400)"
  [ -n "$result" ] || result="$(tail -n 1 "$log" | cut -c1-200)"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status="TIMEOUT after ${limit}s"
  elif [ "$CUDA" = 0 ] && [ "$nocuda" = pytest ] && [ "$rc" = 5 ] && grep -q "deselected: no CUDA" <(tail -n +"$first" "$log"); then
    status="no CUDA"
  elif [ "$CUDA" = 0 ] && [ "$nocuda" != "-" ] && [ "$nocuda" != pytest ]; then
    if [ "$rc" = 0 ]; then status="no CUDA"; result="CPU toy run ok: ${result}"; else status="FAILED (CPU toy run, exit $rc)"; fi
  elif [ "$rc" != 0 ]; then status="FAILED (exit $rc)"
  else status="ok"; fi
  ROW[$stage/$step]="| $step | $status | $took | ${result//|//} |"
  echo "[gpu-check $((SECONDS - STAGE_START))s] $step: $status in ${took}s"
  write_stage "$stage"
  case "$status" in FAILED*|TIMEOUT*) return 1 ;; esac
  return 0
}

# run_stage STAGE FORCE: the stage's steps not done yet (FORCE=1: all), install first where needed
run_stage() {
  local stage="$1" force="$2" s step limit exp nocuda cmd failed=0 stamp hash todo=()
  STAGE_START=$SECONDS
  BUDGET=$((STAGE_LIMIT[stage] * SLOWDOWN))
  [ -f "$RESULTS/stage$stage.md" ] && cp "$RESULTS/stage$stage.md" "$RESULTS/stage$stage.md.old"
  while IFS='|' read -r s step limit exp nocuda cmd; do
    [ "$s" = "$stage" ] && [ "$step" != install ] || continue
    [ -z "$ONLY" ] || [[ " $ONLY " == *" $step "* ]] || continue
    if [ "$force" = 1 ] || ! is_done "$stage" "$step"; then todo+=("$step"); fi
  done < <(plan)
  echo "[gpu-check] stage $stage: ${todo[*]:-nothing left} (budget ${BUDGET}s)"
  [ "${#todo[@]}" -gt 0 ] || return 0
  stamp="$VENV/.ts_gpu_check_installed"
  hash="$(cat "$WH/SHA256SUMS" "$ROOT/setup.py" "$ROOT/scripts/gpu/node_install.sh" <(command -v "$PY") 2>/dev/null \
          | sha256sum | cut -c1-16)"
  IFS='|' read -r s step limit exp nocuda cmd < <(plan | awk -F'|' -v s="$stage" '$1 == s && $2 == "install"')
  if [ "$DRY" = 0 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
    ROW[$stage/install]="| install | ok | 0 | reused the venv $VENV of an earlier stage on this machine |"
    write_stage "$stage"
  else
    run_step "$stage" install "$limit" "$nocuda" "$cmd"
    if [ "$DRY" = 0 ]; then
      if [[ "${ROW[$stage/install]:-}" == "| install | ok "* ]]; then
        echo "$hash" > "$stamp"
      else
        for step in "${todo[@]}"; do
          ROW[$stage/$step]="| $step | not run (install failed) | 0 | see check.log |"
        done
        write_stage "$stage"
        return 1
      fi
    fi
  fi
  # pytest-xdist (the node image has it): the GPU test files side by side (without CUDA they are all
  # deselected, and pytest says so in its summary, which xdist's workers would keep to themselves)
  [ "$DRY" = 0 ] && [ "$CUDA" = 1 ] && "$VPY" -c 'import xdist' 2>/dev/null && XDIST="-n 4 --dist loadfile"
  for step in "${todo[@]}"; do
    IFS='|' read -r s step limit exp nocuda cmd < <(plan | awk -F'|' -v s="$stage" -v n="$step" '$1 == s && $2 == n')
    run_step "$stage" "$step" "$limit" "$nocuda" "$cmd" || failed=1
  done
  rm -f "$RESULTS/stage$stage.md.old"
  return "$failed"
}

check_wheelhouse() {
  local missing=0 spec name version list
  for list in core.txt fallback.txt fairseq.txt SHA256SUMS; do
    [ -f "$WH/$list" ] || { echo "missing $WH/$list: run scripts/gpu/prepare_offline.sh first"; return 1; }
  done
  while read -r spec; do
    [ -n "$spec" ] || continue
    name="$(echo "${spec%%==*}" | tr 'A-Z-' 'a-z_')"; version="${spec##*==}"
    ls "$WH" | tr 'A-Z' 'a-z' | grep -qE "^${name}-${version}(-|\.tar\.gz)" || { echo "missing in wheelhouse: $spec"; missing=1; }
  done < <(cat "$WH/core.txt" "$WH/fallback.txt" "$WH/fairseq.txt")
  if [ -f "$WH/fairseq-wheel.txt" ]; then
    [ -f "$WH/$(cut -d' ' -f1 "$WH/fairseq-wheel.txt")" ] || { echo "missing in wheelhouse: the fairseq wheel"; missing=1; }
  fi
  (cd "$WH" && sha256sum --quiet -c SHA256SUMS) || { echo "wheelhouse checksums differ"; missing=1; }
  [ "$missing" = 0 ] && echo "wheelhouse complete: $(ls "$WH" | wc -l) files, $(du -sh "$WH" | cut -f1)$(
    [ -f "$WH/fairseq-wheel.txt" ] && echo ", prebuilt fairseq: $(cut -d' ' -f2- "$WH/fairseq-wheel.txt")")"
  return "$missing"
}

# --- main
DRY=0
XDIST=""
case "$MODE" in
  plan) check_plan; exit $? ;;
  print-next) cuda_now && CUDA=1; next_stage; exit 0 ;;
  dry) DRY=1 ;;
esac
check_plan || { echo "[gpu-check] error: the plan does not fit (above)" >&2; exit 2; }
check_wheelhouse || { echo "[gpu-check] error: the wheelhouse is incomplete (above)" >&2; exit 2; }
mkdir -p "$RESULTS"
cuda_now && CUDA=1
DEVICE="$(device_line)"
echo "[gpu-check] $DEVICE"
echo "[gpu-check] repository $ROOT, results $RESULTS${OUT_DIR:+ (and $OUT_DIR)}, venv $VENV$([ "$DRY" = 1 ] && echo ', DRY RUN')"
[ "$CUDA" = 1 ] || echo "[gpu-check] no CUDA: the GPU tests are deselected and the GPU benchmarks not run (reported as 'no CUDA')"
FAILED=0
if [ "$MODE" = stage ] && [ "$STAGE_ARG" != all ]; then
  run_stage "$STAGE_ARG" 1 || FAILED=1
elif [ "$MODE" = stage ]; then
  # with GPU_CHECK_ONLY the steps named run again wherever they are, as with --stage N
  for stage in "${STAGES[@]}"; do run_stage "$stage" "$([ -n "$ONLY" ] && echo 1 || echo 0)" || FAILED=1; done
else
  stage="$(next_stage)"
  if [ "$stage" = none ]; then echo "[gpu-check] every stage is done (results in $RESULTS; --stage N runs one again)"
  else run_stage "$stage" 0 || FAILED=1; fi
fi
[ "$DRY" = 1 ] && exit 0
write_summary
cat "$RESULTS/summary.md"
left="$(next_stage)"
[ "$left" = none ] || echo "[gpu-check] not done yet: stage $left (run the check again; on a fresh machine carry $RESULTS along)"
exit "$FAILED"
