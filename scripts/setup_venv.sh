#!/usr/bin/env bash
# Create .venv and install FreeScale into it (idempotent, quiet).
#   scripts/setup_venv.sh          runtime only
#   scripts/setup_venv.sh test     + dev tools, TorchRec interop, Triton (interpreter tests), NIXL
set -euo pipefail
cd "$(dirname "$0")/.."
want=${1:-run}
py=${PYTHON:-python3}
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "FreeScale needs Python >= 3.11 (found $("$py" --version))" >&2; exit 1; }
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
stamp=".venv/.installed-$want-$(cat pyproject.toml scripts/setup_venv.sh | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0
echo "setting up .venv ($want) ..." >&2
# The CPU build of torch; pip finds it among the local wheels on CI machines.
.venv/bin/python -c 'import torch' 2>/dev/null || "${pip[@]}" torch==2.13.0
if [ "$want" = test ]; then
  # data: pyarrow, so the Parquet/CSV tests run (~3 s); tensorboard: the run directory's events;
  # rdma: NIXL, so the smfree-nixl tests run
  "${pip[@]}" -e ".[dev,bench,data,tensorboard,rdma]"
  # torchrec's metadata asks for the CUDA fbgemm-gpu: install the CPU build with
  # --no-deps, then torchrec's own small dependencies explicitly.
  "${pip[@]}" --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
  "${pip[@]}" tensordict==0.15.3 torchmetrics==1.0.3 tqdm pyre-extensions==0.0.32 triton==3.6.0
else
  "${pip[@]}" -e .
fi
touch "$stamp"
