#!/usr/bin/env bash
# The README's test command: create/reuse .venv, install, run the whole pytest suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/install.sh"
cd "$ROOT"
# Where PYTHONDONTWRITEBYTECODE is set (as on the project's machines), every process the suite
# starts would compile the plugin's sources again (~0.45 s each): compile them once here.
"$ROOT/.venv/bin/python" -m compileall -q -j 0 torchscale_fairseq tests data_prep scripts benchmarks experiments >/dev/null
# Without arguments: the whole suite on two pytest-xdist workers, one test file per worker at a time
# (`--dist loadfile`: a file's module fixtures are built once). Nearly every process the suite starts
# runs one thread (tests/helpers/cli_utils.py), so one pytest process leaves the second core idle between
# the multi-process tests. TS_TEST_WORKERS=0: one process, as before.
if [ $# -eq 0 ]; then
  WORKERS="${TS_TEST_WORKERS:-2}"
  [[ "$WORKERS" =~ ^[0-9]+$ ]] || { echo "[test] error: TS_TEST_WORKERS=$WORKERS: give a number of workers (0: no xdist)" >&2; exit 2; }
  set -- tests
  [ "$WORKERS" = 0 ] || set -- tests -n "$WORKERS" --dist loadfile
fi
exec "$ROOT/.venv/bin/python" -m pytest "$@"
