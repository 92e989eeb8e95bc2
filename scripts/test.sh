#!/usr/bin/env bash
# The README's test command: create/reuse .venv, install, run the whole pytest suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/install.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "${@:-tests}"
