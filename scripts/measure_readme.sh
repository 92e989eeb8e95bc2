#!/usr/bin/env bash
# The README's two timings, measured as a new user meets them: `bash scripts/demo.sh` and
# `bash scripts/test.sh`, each from its own fresh clone of this checkout's HEAD in a new folder
# (so each creates its .venv and installs from scratch), one after the other. Appends one JSON line
# to docs/compat/readme_timings.jsonl (date, commit, machine, load average before each command,
# both wall times, pytest's own time and counts, the demo's figures and the demo venv's Python, torch,
# NumPy, transformers, safetensors and fairseq) and regenerates the README's
# timings sentence from it (scripts/readme_timings.py).
#
#   bash scripts/measure_readme.sh            # about 30 min on 2 idle cores; run it on idle cores
#   MEASURE_DIR=/tmp/m bash scripts/measure_readme.sh   # where the clones go (default: a new mktemp folder)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMMIT="$(git -C "$ROOT" rev-parse HEAD)"
MEASURE_DIR="${MEASURE_DIR:-$(mktemp -d /tmp/ts-readme-XXXXXX)}"
die() { echo "[measure_readme] error: $*" >&2; exit 2; }
[ ! -e "$MEASURE_DIR/demo" ] && [ ! -e "$MEASURE_DIR/test" ] \
  || die "$MEASURE_DIR already holds demo/ or test/: give a new MEASURE_DIR (each command needs a fresh clone)"
[ -z "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ] \
  || echo "[measure_readme] warning: uncommitted changes are not in the clones; measuring $COMMIT" >&2

load() { cut -d' ' -f1 /proc/loadavg; }

# run NAME COMMAND...: clone HEAD into $MEASURE_DIR/NAME, run the command there, print its seconds
run() {
  local name="$1"; shift
  git clone -q "$ROOT" "$MEASURE_DIR/$name"
  git -C "$MEASURE_DIR/$name" checkout -q "$COMMIT"
  echo "[measure_readme] $name: $* in $MEASURE_DIR/$name (load $(load)); log $MEASURE_DIR/$name.log" >&2
  local start=$SECONDS
  (cd "$MEASURE_DIR/$name" && env -u VENV "$@") >"$MEASURE_DIR/$name.log" 2>&1 || die "$* failed; see $MEASURE_DIR/$name.log"
  echo $((SECONDS - start))
}

demo_load="$(load)"
demo_s="$(run demo bash scripts/demo.sh)"
test_load="$(load)"
test_s="$(run test bash scripts/test.sh)"

python3 "$ROOT/scripts/readme_timings.py" record "$COMMIT" "$demo_s" "$demo_load" "$MEASURE_DIR/demo.log" \
  "$test_s" "$test_load" "$MEASURE_DIR/test.log" "$MEASURE_DIR/demo/.venv/bin/python"
python3 "$ROOT/scripts/readme_timings.py" readme
echo "[measure_readme] recorded in docs/compat/readme_timings.jsonl; README's timings sentence regenerated" >&2
