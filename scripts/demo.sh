#!/usr/bin/env bash
# Set up .venv (if needed) and run the main job on the embedded default data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh run
exec .venv/bin/freescale train "$@"
