#!/usr/bin/env bash
# The README's test command: create/reuse .venv, install, run the whole pytest suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/install.sh"
cd "$ROOT"
# Where PYTHONDONTWRITEBYTECODE is set (as on the project's machines), every process the suite
# starts would compile the plugin's sources again (~0.45 s each): compile them once here.
"$ROOT/.venv/bin/python" -m compileall -q -j 0 torchscale_fairseq tests data_prep scripts benchmarks >/dev/null
exec "$ROOT/.venv/bin/python" -m pytest "${@:-tests}"
