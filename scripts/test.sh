#!/usr/bin/env bash
# Set up .venv (if needed), lint, and run the test suite on the CPU.
#   bash scripts/test.sh                  # every test but the slow ones
#   bash scripts/test.sh -m slow          # the slow ones (each has a fast twin above)
#   bash scripts/test.sh tests/jagged -x  # any pytest arguments (slow ones left out
#                                         # unless a -m is given)
# Test files run in pytest-xdist workers, one per core up to 4
# (FREESCALE_TEST_WORKERS=N to choose; 1 runs in this process): most tests
# wait on processes they start, so two workers on two cores take ~2/3 the time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --diff . | head -50; exit 1; }
select=(-m "not slow")
cores=$(nproc 2>/dev/null || echo 1)
workers=${FREESCALE_TEST_WORKERS:-$((cores < 4 ? cores : 4))}
for arg in "$@"; do
  [ "$arg" = -m ] && select=()
  [ "$arg" = -n ] && workers=1  # the caller chose
done
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${parallel[@]}" "${select[@]}" "$@"
