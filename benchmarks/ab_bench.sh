#!/usr/bin/env bash
# Offline A/B of two source trees on one machine: W3 and W1 on the 0.5b and 7b shapes, alternating
# (A B A B ...) so drift shows as spread, not as a difference between the trees.
#
#   OUT=/some/dir bash benchmarks/ab_bench.sh TREE_A TREE_B [REPEATS] [SCALE]
#
# TREE_A / TREE_B: folders that each hold a `hayabusa/` package (e.g. this checkout and
# `git archive <commit> hayabusa | tar -x -C old`). Each run is its own process, started from a neutral working
# directory with only its tree on PYTHONPATH (`python -m` puts the working directory first on sys.path). The
# checkpoints are made once, by TREE_B, under MODEL_DIR (default /tmp/hayabusa_models). Results: one bench JSON per
# run in $OUT/ab/, and a table on stdout and in $OUT/ab_summary.txt (median and range per tree, B / A).
set -u
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); REPEATS=${3:-2}; SCALE=${4:-1}
OUT=${OUT:?set OUT}; EXTRA=${AB_PYTHONPATH:-}
MODELS=${MODEL_DIR:-/tmp/hayabusa_models}
SHAPES=${AB_SHAPES:-qwen2.5-0.5b-shape qwen2.5-7b-shape}
WORKLOADS=${AB_WORKLOADS:-W3,W1}
mkdir -p "$OUT/ab"
NEUTRAL=$(mktemp -d)
cd "$NEUTRAL" || exit 1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
for shape in $SHAPES; do
  [ -s "$MODELS/$shape/bench_shape.json" ] ||
    PYTHONPATH=$B:$EXTRA python -m hayabusa.bench.cli --make-model "$shape" "$MODELS/$shape" || exit 1
done
for r in $(seq 1 "$REPEATS"); do
  for shape in $SHAPES; do
    for tree in A B; do
      dir=$A; [ "$tree" = B ] && dir=$B
      echo "=== repeat $r $shape $tree"
      PYTHONPATH=$dir:$EXTRA timeout -k 10 ${AB_RUN_TIMEOUT_S:-240} python -m hayabusa.bench.cli --no-tqdm \
        --scale "$SCALE" --workload "$WORKLOADS" --model "$MODELS/$shape" \
        --json "$OUT/ab/${tree}_${shape}_r${r}.json" 2>&1 | tail -8
    done
  done
done
python - "$OUT/ab" <<'PY' | tee "$OUT/ab_summary.txt"
import glob, json, os, statistics, sys
rows = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    tree = os.path.basename(path).split("_", 1)[0]
    recs = json.load(open(path))
    for rec in recs if isinstance(recs, list) else [recs]:
        w = rec.get("workload")
        value = rec.get("tpot_ms") if w == "W3" else rec.get("output_throughput")
        if value is not None:
            rows.setdefault((rec.get("model"), w), {}).setdefault(tree, []).append(float(value))
print(f"{'shape':<22}{'metric':<18}{'A median (range)':<34}{'B median (range)':<34}B / A")
for (model, w), by_tree in sorted(rows.items()):
    unit = "ms/token" if w == "W3" else "out tok/s"
    cells, med = [], {}
    for t in ("A", "B"):
        v = by_tree.get(t, [])
        med[t] = statistics.median(v) if v else None
        cells.append(f"{med[t]:,.2f} ({min(v):,.2f}-{max(v):,.2f})" if v else "-")
    ratio = f"{med['B'] / med['A']:.3f}" if med["A"] and med["B"] else "-"
    print(f"{model:<22}{w + ' ' + unit:<18}{cells[0]:<34}{cells[1]:<34}{ratio}")
PY
