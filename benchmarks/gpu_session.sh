#!/usr/bin/env bash
# One scripted GPU session on an H200 machine (no network, no installs):
#   bash benchmarks/gpu_session.sh <results-dir> <part> [<part> ...]
# parts: check (GPU tests), kernels (1 GPU), embedding (2 GPUs),
#   scaling21k / scaling8k (world sizes 2 and 4 when the machine has them:
#   none/fbs/cost at batch 128, 60 steps), sdd21k (the same in sdd mode, 2 GPUs),
#   straggler21k (2 GPUs, batch 32 and 128, none/fbs/vbs/cost),
#   metrics (the regression guard: 1 GPU loader rate + data-wait checks, and
#   with 2+ GPUs the none/fbs/cost sweep checked by check_metrics.py; a
#   failed check fails the session: run it after any change to the step,
#   the loader or the balancer), synccheck (1 GPU: every host-GPU sync
#   call site of sync/sdd, balanced or not), overhead (1 GPU: host overhead,
#   GPU idle %, peak memory at UIH 2k/8k/21k x batch 32/128 x sync/sdd/freescale;
#   fails on an idle rise over benchmarks/results/overhead-baseline.json),
#   overhead-graphs (the same with dense_graphs=true, against
#   overhead-baseline-graphs.json), grid-<batch>-<graphs> (one batch size),
#   b32g/b128g (graphs grid keeping the 2k traces), diag32/waits32 (where the
#   batch-32 steps idle: trace gaps, sync_debug waits, cProfile), split32
#   (freescale's prioritized split kept at one rank: prioritize=on), r2k32
#   (UIH 2k batch 32, median of 3 runs per mode), t2k32 (the same as 3 grids, traces kept),
#   smalltable (benchmarks/small_table.py: the small-table gradient and column sums vs torch).
# Everything runs from the checkout (PYTHONPATH). Sweep outputs are packed
# into one .tgz per part (the device returns at most 8 files).
set -uo pipefail
out=$1; shift
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# NVLink multicast stays off (machine policy); keep whatever the machine set.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
sizes=2; [ "$ngpu" -ge 4 ] && sizes=2,4; [ "$ngpu" -ge 8 ] && sizes=2,4,8
echo "== $* on $ngpu GPU(s): $(python3 -c 'import torch,triton; print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))')"
pack() {  # $1: sweep output stem; keeps JSON lines and rank-0 traces
  local d; d=$(dirname "$1"); local s; s=$(basename "$1")
  rm -f "$d/$s-steps/"*.rank[1-9]*.json.gz
  tar czf "$1.tgz" -C "$d" "$s.md" "$s.json" "$s-steps" $( [ -f "$1.png" ] && echo "$s.png" )
  rm -rf "$1-steps" "$1.json"
}
grid() {  # $1 batch, $2 dense_graphs [, keep]: one overhead grid (its step lines: steps.tgz)
  local stem="$out/overhead-b$1-graphs-$2"
  timeout 400 python3 benchmarks/overhead.py --batch "$1" --set dense_graphs="$2" --out "$stem" \
    2>&1 | grep -E "^\[|^\||rror|  File " | tail -40
  if [ "${3:-}" = keep ]; then
    for m in sync freescale; do
      cp "$stem-steps/"*uih2000*mode$m-trace.json.gz "$out/trace-b$1-2k-$m.json.gz"
    done
  fi
  rm -f "$stem-steps/"*-trace.json.gz
}
status=0
for part in "$@"; do
  case $part in
    check)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 \
        | tee "$out/gpu_tests.log" | tail -8 ;;
    updatebits)  # the compiled update vs a base version (benchmarks/base_update.py, untracked)
      timeout 200 python3 benchmarks/update_bitwise.py --base-file benchmarks/base_update.py \
        --cases 300 --time 2>&1 | tee "$out/update-bitwise.log" | tail -12 ;;
    smalltable)  # issue 18: small-table gradient, column sums and Linear vs torch (µs)
      timeout 120 python3 benchmarks/small_table.py --out "$out/small-table-1xH200.md" 2>&1 | tail -12 ;;
    kernels)
      timeout 200 python3 benchmarks/kernels.py --out "$out/kernels_1xH200.md" 2>&1 \
        | grep -E "^target|copy bandwidth" ;;
    embedding)
      timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/embedding.py \
        --out "$out/embedding_2xH200.md" 2>&1 | grep -v Warning | tail -12 ;;
    lookup1)  # issue 18: the lookup's 1e7-row shortfall — table size or id distribution?
      for alpha in 1.05 0; do
        timeout 150 torchrun --standalone --nproc-per-node 1 benchmarks/embedding.py \
          --rows 1e7,1e8 --alpha $alpha --out "$out/embedding-1xH200-alpha$alpha.md" 2>&1 \
          | grep -v Warning | tail -4
      done ;;
    scaling21k|scaling8k)
      uih=21000; [ "$part" = scaling8k ] && uih=8000
      timeout 590 python3 benchmarks/scaling.py --preset h200-21k --nproc "$sizes" \
        --max-uih $uih --batch 128 --balance none,fbs,cost --steps 60 --warmup 10 \
        --trace-steps 40-41 --out "$out/$part" 2>&1 | grep "^\[" ;
      pack "$out/$part" ;;
    sdd21k)
      timeout 590 python3 benchmarks/scaling.py --preset h200-21k --nproc 2 --modes sdd \
        --max-uih 21000 --batch 128 --balance none,fbs,cost --steps 60 --warmup 10 \
        --trace-steps 40-41 --out "$out/$part" 2>&1 | grep "^\[" ;
      pack "$out/$part" ;;
    straggler21k)
      timeout 590 python3 benchmarks/straggler.py --preset h200-21k --nproc 2 \
        --max-uih 21000 --batch 32,128 --balance none,fbs,vbs,cost \
        --steps 60 --warmup 10 --trace-steps 40-41 --out "$out/$part" 2>&1 | grep "^\[" ;
      pack "$out/$part" ;;
    metrics)
      timeout 400 python3 benchmarks/data_wait.py --preset h200-21k --batch 128 \
        --out "$out/data-wait-1xH200" 2>&1 | grep -vi warn | tail -22 || status=1
      if [ "$ngpu" -ge 2 ]; then
        timeout 590 python3 benchmarks/scaling.py --preset h200-21k --nproc 2 --modes sync,sdd \
          --max-uih 21000 --batch 128 --balance none,fbs,cost --steps 60 --warmup 10 \
          --out "$out/metrics2gpu" 2>&1 | grep "^\[" ;
        python3 benchmarks/check_metrics.py "$out/metrics2gpu.json" || status=1
        pack "$out/metrics2gpu"
      fi ;;
    synccheck)
      for args in "mode=sync balance=none" "mode=sdd balance=none" "mode=freescale balance=none" \
                  "mode=sync balance=cost" "mode=freescale balance=cost"; do
        echo "-- $args"
        timeout 200 python3 -m freescale.cli.main train --preset h200-21k --set nproc=1 \
          --set steps=14 --set warmup=8 --set batch_size=64 --set sync_debug=true \
          $(printf -- '--set %s ' $args) 2>&1 | grep -E "host sync|^    |sync_debug|Error" | head -40
      done ;;
    freescale1)  # issue 11 on one GPU: parity, step time, host syncs, trace, split/merge cost
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/embedding/test_prioritized_gpu.py tests/kernels/test_update.py 2>&1 | tail -3 \
        || status=1
      common="--preset h200-21k --set nproc=1 --set steps=20 --set warmup=8 --set batch_size=64
        --set progress=false"
      common="$common --set prioritize=on"  # the split at one rank (auto: sdd's schedule)
      for run in sync sync2 sdd freescale; do
        timeout 200 python3 -m freescale.cli.main train $common --mode "${run%2}" \
          --set metrics_path="$out/w1-$run.jsonl" 2>&1 | tail -1 > "$out/w1-$run.json"
      done
      python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
runs = ("sync", "sync2", "sdd", "freescale")
loss = {r: [json.loads(l)["loss"] for l in open(f"{out}/w1-{r}.jsonl")] for r in runs}
for r in runs:
    s = json.load(open(f"{out}/w1-{r}.json"))
    d = max(abs(a - b) for a, b in zip(loss[r], loss["sync"]))
    e = s["exposed_comm_ms"]
    print(f"{r:9s} step {s['step_ms']:7.2f} ms  ids/emb/grad {e['ids_a2a']:.2f}/{e['emb_a2a']:.2f}/"
          f"{e['grad_a2a']:.2f} ms  collision rows {s['collision_rows_pct']:.1f}%  "
          f"max |loss - sync| {d:.2e}")
PY
      timeout 200 python3 -m freescale.cli.main train $common --mode freescale \
        --set sync_debug=true --set trace_path="$out/fs-trace.json.gz" --set trace_steps=12-13 \
        2>&1 | grep -E "host sync|^    |sync_debug|Error" | grep -v "prototype\|launch.py" | head -30
      python3 -m freescale.cli.main trace "$out/fs-trace.json.gz" 2>&1 | head -24
      timeout 120 python3 benchmarks/collision.py --preset h200-21k --batch 64 \
        --out "$out/collision-1xH200" 2>&1 | tail -7 ;;
    nonfinite)  # issue 13 point 3 on one GPU: the guard's parity, a blow-up, its cost
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/embedding/test_nonfinite.py \
        tests/kernels/test_update.py 2>&1 | tail -3 || status=1
      start=$(date +%s)
      timeout 200 python3 -m freescale.cli.main train --preset h200-8k --set nproc=1 \
        --set steps=30 --set warmup=2 --set batch_size=16 --set dense_lr=1e30 --set emb_lr=1e30 \
        2>&1 | grep -E "error|Error" | tail -2
      echo "blow-up run ended after $(( $(date +%s) - start )) s (startup included)"
      for mode in sync freescale; do
        timeout 200 python3 -m freescale.cli.main train --preset h200-21k --set nproc=1 \
          --set steps=20 --set warmup=8 --set batch_size=64 --set progress=false --mode $mode \
          2>&1 | tail -1 > "$out/nf-$mode.json"
      done
      step=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['step_ms'])" "$out/nf-sync.json")
      timeout 200 python3 benchmarks/nonfinite_cost.py --preset h200-21k --batch 64 \
        --step-ms "$step" --out "$out/nonfinite-cost-1xH200" 2>&1 | tail -9 ;;
    hostprofile)  # issue 18: where the host time goes at batch 32 (cProfile, W = 1)
      timeout 200 python3 benchmarks/host_profile.py --preset h200-21k --batch 32 --steps 40 \
        --out "$out/host-profile-21k-b32.txt" 2>&1 | grep -A14 "by tottime" | tail -12 ;;
    diag32)  # issue 18: where the batch-32 graph steps idle (trace gaps, host waits, cProfile)
      for u in 2000 21000; do
        timeout 200 python3 -m freescale.cli.main train --preset h200-21k --set nproc=1 \
          --set steps=40 --set warmup=20 --set batch_size=32 --set max_uih=$u \
          --set dense_graphs=true --set progress=false --set trace_path="$out/t$u.json.gz" \
          --set trace_steps=30-32 2>&1 | tail -1 | cut -c1-400
        python3 -m freescale.cli.main trace "$out/t$u.json.gz" --min-gap-us 200 --min-wait-us 300 \
          > "$out/trace-b32-$u.txt" 2>&1; head -60 "$out/trace-b32-$u.txt"; rm -f "$out/t$u.json.gz"
      done
      timeout 200 python3 benchmarks/host_profile.py --preset h200-21k --batch 32 --steps 50 \
        --from-step 20 --set max_uih=2000 --set dense_graphs=true --top 45 \
        --out "$out/host-profile-2k-b32-graphs.txt" 2>&1 | grep -A30 "by tottime" | tail -28 ;;
    waits32)  # issue 18: which call sites make the host wait at batch 32 (sync_debug), and the trace
      for u in 2000 21000; do for m in sync sdd; do
        echo "-- uih $u $m"
        timeout 200 python3 -m freescale.cli.main train --preset h200-21k --set nproc=1 \
          --set steps=40 --set warmup=20 --set batch_size=32 --set max_uih=$u --mode $m \
          --set dense_graphs=true --set progress=false --set sync_debug=true \
          --set trace_path="$out/t$u$m.json.gz" --set trace_steps=30-32 2>&1 \
          | grep -E "sync_debug|host sync|^    |Error" | grep -v "prototype\|launch.py" | head -24
        python3 -m freescale.cli.main trace "$out/t$u$m.json.gz" --min-gap-us 200 --min-wait-us 300 \
          > "$out/trace-b32-$u-$m.txt" 2>&1; sed -n 3p "$out/trace-b32-$u-$m.txt"
        grep -A6 "per step" "$out/trace-b32-$u-$m.txt" | tail -3; rm -f "$out/t$u$m.json.gz"
      done; done ;;
    b32g|b128g)  # issue 18: the graphs grid at one batch size, keeping the 2k sync/freescale traces
      b=${part#b}; grid "${b%g}" true keep ;;
    r2k32)  # UIH 2k batch 32, graphs, 3 runs per mode (median): the noisiest preset
      timeout 300 python3 benchmarks/overhead.py --batch 32 --max-uih 2000 --repeat 3 \
        --set dense_graphs=true --out "$out/overhead-r3-b32-2k" 2>&1 | grep -E "^\[|^\|" | tail -6
      python3 -c "import json,sys; [print(r['mode'], r['gpu_idle_pct_runs']) for r in json.load(open(sys.argv[1]))['rows']]" \
        "$out/overhead-r3-b32-2k.json"; rm -rf "$out/overhead-r3-b32-2k-steps" ;;
    models)  # the GPU tests of the model (graphs, streams) only
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models 2>&1 \
        | tee "$out/gpu_tests_models.log" | tail -4 ;;
    ab2k)  # UIH 2k batch 32 sync, graphs with 1 vs 2 streams, alternated twice (traces kept)
      for r in 1 2; do for s in 1 2; do
        timeout 120 python3 benchmarks/overhead.py --batch 32 --max-uih 2000 --modes sync \
          --set dense_graphs=true --set dense_graph_streams=$s --out "$out/ab-s$s-r$r" 2>&1 \
          | grep -E "^\[" | sed "s/^/streams $s: /"
      done; done
      tar czf "$out/ab2k.tgz" -C "$out" $(cd "$out" && ls -d ab-*) && rm -rf "$out"/ab-* ;;
    conn2k)  # the same as ab2k's 2-stream point with CUDA_DEVICE_MAX_CONNECTIONS=32 (default 8)
      CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 120 python3 benchmarks/overhead.py --batch 32 \
        --max-uih 2000 --modes sync --set dense_graphs=true --out "$out/conn32" 2>&1 \
        | grep -E "^\[" | sed "s/^/connections 32: /"
      tar czf "$out/conn2k.tgz" -C "$out" conn32.md conn32-steps && rm -rf "$out"/conn32* ;;
    t2k32)  # UIH 2k batch 32, graphs: 3 separate grids (sync/sdd/freescale), every trace kept
      for i in $(seq 1 "${T2K_RUNS:-3}"); do
        timeout 200 python3 benchmarks/overhead.py --batch 32 --max-uih 2000 \
          --set dense_graphs=true --out "$out/o2k-$i" 2>&1 | grep -E "^\[" | tail -3
      done
      tar czf "$out/t2k32.tgz" -C "$out" $(cd "$out" && ls -d o2k-*) && rm -rf "$out"/o2k-* ;;
    split32)  # freescale's split at one rank (prioritize=on), 2k batch 32, graphs: its cost
      timeout 200 python3 benchmarks/overhead.py --batch 32 --max-uih 2000 --modes sync,freescale \
        --set dense_graphs=true --set prioritize=on --out "$out/overhead-split-b32-2k" 2>&1 \
        | grep -E "^\[|^\|" | tail -6; rm -rf "$out/overhead-split-b32-2k-steps" ;;
    grid-*)  # issue 18: grid-<batch>-<dense_graphs>, e.g. grid-128-false: one overhead grid
      IFS=- read -r _ b g <<< "$part"; grid "$b" "$g" ;;
    smfree1)  # issue 12 on one GPU: processes sharing it
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/comm/test_smfree_gpu.py 2>&1 \
        | tail -5 || status=1
      timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/comm_bandwidth.py \
        --device cuda --backends smfree-shm,smfree-gloo --out "$out/comm-bandwidth-1xH200-2proc.md" \
        > "$out/comm-bandwidth.log" 2>&1; tail -5 "$out/comm-bandwidth.log"
      timeout 300 python3 benchmarks/interference.py --out "$out/interference-1xH200" 2>&1 \
        | grep -v Warning | tail -16 ;;
    overhead|overhead-graphs)  # issue 18: 18 points x 40 steps (3 profiled), one process each
      # against the baseline recorded with the same settings (eager / dense_graphs=true)
      set_=(); base=benchmarks/results/overhead-baseline.json; name=overhead-1xH200
      if [ "$part" = overhead-graphs ]; then
        set_=(--set dense_graphs=true); base=benchmarks/results/overhead-baseline-graphs.json
        name=overhead-graphs-1xH200
      fi
      timeout 580 python3 benchmarks/overhead.py --out "$out/$name" "${set_[@]}" --baseline "$base" \
        2>&1 | grep -E "^\[|^\||REGRESSION|error" ; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      tar czf "$out/$name-steps.tgz" -C "$out" --exclude="*-trace.json.gz" "$name-steps" \
        && rm -rf "$out/$name-steps" ;;
    graphs32|graphs128)  # issue 18: CUDA graphs of the dense blocks vs eager, one batch size
      b=${part#graphs}
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models 2>&1 \
        | tee "$out/gpu_tests_models_$b.log" | tail -4
      grid "$b" true; grid "$b" false ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
# Step lines of the grids, in one file (the device returns at most 8).
if compgen -G "$out/overhead-b*-steps" > /dev/null; then
  (cd "$out" && tar czf steps.tgz --remove-files ./overhead-b*-steps)
fi
exit $status
