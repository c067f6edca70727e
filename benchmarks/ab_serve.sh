#!/usr/bin/env bash
# W6 A/B of two source trees on one machine, alternating (A B A B) so drift shows as spread, not as a difference.
#
#   OUT=/some/dir bash benchmarks/ab_serve.sh TREE_A TREE_B [RATES] [PROMPTS]
#
# TREE_A / TREE_B: folders that each hold a `hayabusa/` package (e.g. this checkout and
# `git archive <commit> hayabusa | tar -x -C old`). Each server runs from a neutral working directory with only its
# tree on PYTHONPATH (`python -m` puts the working directory first on sys.path, so running from inside a checkout
# would import that checkout whatever PYTHONPATH says). The client is always TREE_A's. Results: $OUT/ab_*.json and a
# table on stdout (rate, output tok/s, TTFT p50/p99 ms, TPOT p50/p99 ms).
set -u
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); RATES=${3:-64,inf}; N=${4:-100}
OUT=${OUT:?set OUT}; EXTRA=${AB_PYTHONPATH:-}   # e.g. /tmp/site where the server wheels were installed
M=${MODEL_DIR:-/tmp/hayabusa_models}/qwen2.5-0.5b-shape
NEUTRAL=$(mktemp -d)
cd "$NEUTRAL" || exit 1
[ -s "$M/bench_shape.json" ] || PYTHONPATH=$A:$EXTRA python -m hayabusa.bench.cli --make-model qwen2.5-0.5b-shape "$M"
run() {  # name tree
  PYTHONPATH=$2:$EXTRA python -m hayabusa.entrypoints.cli serve "$M" --skip-tokenizer-init --served-model-name q05 \
    --disable-log-requests --disable-uvicorn-access-log --max-model-len 1024 --port 8012 > "$OUT/serve_$1.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do
    PYTHONPATH=$A:$EXTRA python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8012/health', timeout=1)" \
      2>/dev/null && break
    sleep 0.5
  done
  PYTHONPATH=$A:$EXTRA python -m hayabusa.bench.cli --workload W6 --base-url http://127.0.0.1:8012 --model q05 \
    --request-rate "$RATES" --num-prompts "$N" --json "$OUT/ab_$1.json" > /dev/null 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null
  python -c "
import json
for r in json.load(open('$OUT/ab_$1.json')):
    print('$1', r['request_rate'], round(r['output_throughput']), round(r['p50_ttft_ms'], 1), round(r['p99_ttft_ms'], 1),
          round(r['p50_tpot_ms'], 2), round(r['p99_tpot_ms'], 2))"
}
run a1 "$A"; run b1 "$B"; run a2 "$A"; run b2 "$B"
