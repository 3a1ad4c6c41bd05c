#!/usr/bin/env bash
# Side-by-side step times of two builds on one GPU, alternating A B A B ...:
#   bash benchmarks/ab_builds.sh <out-dir> <base-tree> [rounds]
# <base-tree>: a copy of the older build (its freescale/ and benchmarks/), e.g.
#   git archive 7f5f77f freescale benchmarks | tar x -C .base
# Points: h200-21k batch 128 eager (the default) and UIH 2k batch 32 with
# dense_graphs=true, mode sync; each a fresh `benchmarks/overhead.py` run of
# 40 steps (mean of the untraced measured steps). Prints one line per run and
# a table of medians; writes ab-builds.md under <out-dir>.
set -uo pipefail
out=$1; base=$2; rounds=${3:-3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
points=("21000 128 false" "2000 32 true")
log="$out/ab-builds.jsonl"; : > "$log"
for r in $(seq 1 "$rounds"); do
  for p in "${points[@]}"; do
    read -r uih batch graphs <<< "$p"
    for build in base new; do
      tree=$PWD; [ "$build" = base ] && tree=$base
      stem="$out/ab-$build-$uih-$batch-r$r"
      PYTHONPATH=$tree timeout 280 python3 "$tree/benchmarks/overhead.py" --max-uih "$uih" \
        --batch "$batch" --modes sync --set dense_graphs="$graphs" --out "$stem" > "$stem.log" 2>&1
      step=$(python3 -c "import json,sys; r=json.load(open('$stem.json')); rows=r['rows'] if isinstance(r,dict) else r; print(rows[0]['step_ms'])" 2>/dev/null || echo nan)
      echo "{\"build\": \"$build\", \"uih\": $uih, \"batch\": $batch, \"graphs\": $graphs, \"round\": $r, \"step_ms\": $step}" | tee -a "$log"
      rm -rf "$stem-steps" "$stem.md"
    done
  done
done
python3 - "$log" "$out/ab-builds.md" <<'PY'
import json, statistics, sys
rows = [json.loads(x) for x in open(sys.argv[1])]
lines = ["| point | base ms (median) | new ms (median) | new / base |", "|---|---|---|---|"]
for uih, batch, graphs in sorted({(r["uih"], r["batch"], r["graphs"]) for r in rows}):
    pick = lambda b: [r["step_ms"] for r in rows if (r["build"], r["uih"], r["batch"], r["graphs"]) == (b, uih, batch, graphs)]
    a, b = statistics.median(pick("base")), statistics.median(pick("new"))
    lines.append(f"| UIH {uih} batch {batch} graphs={graphs} | {a:.2f} {pick('base')} | {b:.2f} {pick('new')} | {b / a:.4f} |")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
