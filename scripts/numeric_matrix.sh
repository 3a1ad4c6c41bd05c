#!/usr/bin/env bash
# The float-sensitive tests (pytest -m numeric: derived tolerances, bitwise
# parity of reductions) under 1, 2, 3 and 4 intra-op threads, then with ATen's
# default (no SIMD) CPU kernels at the native thread count. The thread count
# and the SIMD width change how reductions split: a tolerance that only holds
# on one machine fails here.
#
#   bash scripts/numeric_matrix.sh [pytest args]     # all five legs
#   LEGS="3 default" bash scripts/numeric_matrix.sh   # some of them (CI: one)
#
# Each leg prints its pytest result line and wall time; the script exits
# non-zero if any leg failed (its output's tail is printed). torch caps
# OMP_NUM_THREADS at the cores it sees, so the count also goes explicitly to
# the test process (tests/conftest.py) and the ranks of run_ranks
# (FREESCALE_TEST_THREADS); the launcher's CPU ranks take OMP_NUM_THREADS.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
LEGS=${LEGS:-"1 2 3 4 default"}

failed=()
run_leg() {
  local name=$1
  shift
  local start end out rc
  start=$(date +%s)
  out=$(env "$@" "$PYTHON" -m pytest -q -p no:cacheprovider -m numeric "${ARGS[@]}" 2>&1)
  rc=$?
  end=$(date +%s)
  printf '%-30s %5ss  %s\n' "$name" $((end - start)) "$(tail -n 1 <<<"$out")"
  if [ "$rc" -ne 0 ]; then
    failed+=("$name")
    tail -n 60 <<<"$out" | sed 's/^/    /'
  fi
}

ARGS=("$@")
for leg in $LEGS; do
  if [ "$leg" = default ]; then
    run_leg "ATEN_CPU_CAPABILITY=default" -u OMP_NUM_THREADS -u MKL_NUM_THREADS \
      -u FREESCALE_TEST_THREADS ATEN_CPU_CAPABILITY=default
  else
    run_leg "OMP_NUM_THREADS=$leg" OMP_NUM_THREADS="$leg" MKL_NUM_THREADS="$leg" \
      FREESCALE_TEST_THREADS="$leg"
  fi
done

if [ "${#failed[@]}" -ne 0 ]; then
  echo "numeric matrix: failed legs: ${failed[*]}"
  exit 1
fi
echo "numeric matrix: all legs passed"
