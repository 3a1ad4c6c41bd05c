#!/usr/bin/env bash
# Set up .venv (if needed), lint, and run the test suite on the CPU.
#   bash scripts/test.sh                  # every test but the slow ones
#   bash scripts/test.sh -m slow          # the slow ones (each has a fast twin above)
#   bash scripts/test.sh tests/jagged -x  # any pytest arguments (slow ones left out
#                                         # unless a -m is given)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --diff . | head -50; exit 1; }
select=(-m "not slow")
for arg in "$@"; do
  [ "$arg" = -m ] && select=()
done
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${select[@]}" "$@"
