#!/usr/bin/env bash
# The multi-GPU campaign (issue 19) on one H200 machine (no network, no installs):
#   bash benchmarks/campaign.sh <results-dir> <part>@<W> [...]      e.g. fig8a-hi@8 fig9a@8
#   bash benchmarks/campaign.sh <results-dir> all                    every part the GPUs allow
# Parts, their estimated minutes and the calls per GPU kind:
#   python benchmarks/campaign.py plan      (docs/benchmarks.md, "Campaign")
# Each part leaves one <part>-<W>xH200.tgz (the device returns at most 8 files).
# report / revalidate read the archives back and also run on the CPU afterwards:
#   python benchmarks/campaign.py run OUT report revalidate --from <fetched dir> ...
set -uo pipefail
out=$1; shift
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# NVLink multicast stays off (machine policy); keep whatever the machine set.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
echo "== campaign $* on $(python3 -c 'import torch; print(torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), torch.__version__)')"
python3 benchmarks/campaign.py run "$out" "$@" 2>&1 | tee -a "$out/campaign.log" | grep "^\[campaign\]"
exit "${PIPESTATUS[0]}"
