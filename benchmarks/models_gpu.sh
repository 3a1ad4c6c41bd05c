#!/usr/bin/env bash
# The built-in HSTU-style model and the user example on one GPU (issue 30):
#   bash benchmarks/models_gpu.sh <out-dir>
# HSTU at the demo preset and at UIH 2k batch 32 (the h200 model shape), the
# categories example at the demo preset; each `freescale train` summary line
# goes to <out-dir>/models-gpu.jsonl, a table to stdout.
set -uo pipefail
out=$1; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
hstu="--set model=freescale.models.hstu:build"
runs=(
  "hstu-demo|$hstu --set device=cuda --set nproc=1 --set steps=60 --set eval_every=30"
  "hstu-uih2k-b32|--preset h200-8k $hstu --set max_uih=2000 --set nproc=1 --set batch_size=32 --set steps=40 --set warmup=10 --set model.dim=256 --set model.heads=4 --set model.layers=4"
  "categories-demo|--set model=examples.categories:build --set data=examples.categories:data --set device=cuda --set nproc=1 --set steps=60 --set eval_every=30"
)
: > "$out/models-gpu.jsonl"
for r in "${runs[@]}"; do
  name=${r%%|*}; args=${r#*|}
  # shellcheck disable=SC2086
  timeout 240 python3 -m freescale.cli.main train $args --set progress=false \
    > "$out/$name.out" 2> "$out/$name.err"
  rc=$?
  line=$(tail -n 1 "$out/$name.out")
  echo "{\"run\": \"$name\", \"rc\": $rc, \"summary\": ${line:-null}}" >> "$out/models-gpu.jsonl"
  python3 - "$name" "$rc" "$line" <<'PY'
import json, sys
name, rc, line = sys.argv[1], sys.argv[2], sys.argv[3]
s = json.loads(line) if line.startswith("{") else {}
print(f"{name:18s} rc={rc} steps={s.get('steps')} step_ms={s.get('step_ms', float('nan')):.2f} "
      f"ne={s.get('ne')} train_ne_last={s.get('train_ne_last')}")
PY
  [ "$rc" = 0 ] || tail -5 "$out/$name.err"
done
