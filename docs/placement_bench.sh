#!/usr/bin/env bash
# Placement by prefix against today's placement (whoever reads first), on the same runs:
# WORKERS workers of the bench model on one queue, 8 tenants each with its own
# 1,500-token system prompt and short questions, Poisson arrivals. Each run has new
# prompts (its own seed); the two placements alternate, each with freshly started
# workers (empty caches).
#
#   docs/placement_bench.sh [RUNS] [RATE]     # default 2 runs of each, 2 requests/s; JSON under docs/bench/placement-*
#   WORKERS=3 docs/placement_bench.sh
#   FIRST=3 docs/placement_bench.sh 2 2      # runs 3 and 4 (their own seeds)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-2}; rate=${2:-2}
workers=${WORKERS:-2}
bin=.venv/bin
export MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
model=~/.cache/mlxq/pinned-bench
[ -d "$model" ] || $bin/mlxq demo-model --size bench "$model" >/dev/null
work=$(mktemp -d)
port=$($bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url=redis://127.0.0.1:$port
$bin/mlxq redis --port "$port" --dir "$work" >/dev/null 2>&1 &
until $bin/python -c "import redis; redis.Redis(port=$port).ping()" 2>/dev/null; do sleep 0.2; done
pids=()
stop_workers() {  # (a bare `wait` would wait for the Redis server too)
  [ ${#pids[@]} -eq 0 ] && return
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true; pids=()
}
cleanup() { stop_workers; $bin/mlxq redis stop --port "$port" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT

start_workers() {  # queue, prefix_placement
  local queue=$1 placement=$2
  for i in $(seq "$workers"); do
    $bin/python -m mlxq worker --redis-url "$url" --queue "$queue" --model "$model" --max-num-seqs 8 \
      --consumer "w$i-$queue" --heartbeat-s 1 --prefix-placement "$placement" --log-format json \
      >"$work/$queue-$i.log" 2>&1 &
    pids+=($!)
  done
  for i in $(seq "$workers"); do
    until grep -q '"worker ready"' "$work/$queue-$i.log"; do sleep 0.2; done
  done
}

first=${FIRST:-1}  # the first run's seed (FIRST=3: runs 3, 4, ...)
for run in $(seq "$first" "$((first + runs - 1))"); do
  for placement in true false; do
    queue="place-$placement-$run"
    start_workers "$queue" "$placement"
    $bin/python docs/placement_backlog.py "$url" "$queue" "$(python3 -c "print(64 / $rate + 20)")" &
    sampler=$!
    $bin/mlxq bench --redis-url "$url" --queue "$queue" --requests 64 --rate "$rate" --concurrency 0 \
      --tenants 8 --prefix-len 1500 --input-len 24 --output-len 16 --seed "$run" \
      --json "docs/bench/placement-$placement-$run.json" 2>/dev/null | grep -E "cached prompt|^redis"
    wait "$sampler"
    for i in $(seq "$workers"); do  # each worker's placements
      echo "  w$i: $($bin/mlxq status --redis-url "$url" --queue "$queue" --json | $bin/python -c "import json, sys
w = [w for w in json.load(sys.stdin)['workers'] if w['name'] == 'w$i-$queue'][0]
print({k: v for k, v in w['totals'].items() if k.startswith('placed:') and v}, 'cached', w['totals']['cached_tokens'])")"
    done
    stop_workers
  done
done
