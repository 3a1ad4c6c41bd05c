#!/usr/bin/env bash
# Set up .venv (if needed), lint, and run the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --diff . | head -50; exit 1; }
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
