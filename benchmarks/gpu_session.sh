#!/usr/bin/env bash
# One scripted GPU session on an H200 machine (no network, no installs):
#   bash benchmarks/gpu_session.sh <part> [results-dir]
# parts: check (GPU tests), embedding (1 and 2 GPUs), kernels (1 GPU), baseline (2 GPUs)
# Everything runs from the checkout (PYTHONPATH), logs go to the results dir.
set -uo pipefail
part=$1
out=${2:-${OUT:-benchmarks/results}}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# NVLink multicast stays off (machine policy); keep whatever the machine set.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "== $part on $ngpu GPU(s): $(python3 -c 'import torch,triton; print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))')"
case $part in
  check)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests "${@:3}" 2>&1 | tee "$out/gpu_tests.log" | tail -25
    ;;
  embedding)
    timeout 200 torchrun --standalone --nproc-per-node 1 benchmarks/embedding.py \
      --out "$out/embedding_1xH200.md" 2>&1 | tail -25
    if [ "$ngpu" -ge 2 ]; then
      timeout 240 torchrun --standalone --nproc-per-node 2 benchmarks/embedding.py \
        --out "$out/embedding_2xH200.md" 2>&1 | tail -25
    fi
    ;;
  kernels)
    timeout 300 python3 benchmarks/kernels.py --out "$out/kernels_1xH200.md" 2>&1 | tail -40
    ;;
  baseline)
    timeout 560 python3 benchmarks/train_baseline.py --preset h200-21k --nproc 2 \
      --max-uih 8000,21000 --batch 32,128 --modes sync,sdd --steps 30 --warmup 8 \
      --out "$out/train-baseline-2xH200" 2>&1 | grep -v Warning | tail -20
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
