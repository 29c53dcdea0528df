#!/usr/bin/env bash
# Redis calls a run costs, by command: Valkey's INFO commandstats over one `mlxq bench`
# run at concurrency 16, placed as docs/bench_pinned.sh places it (Linux: taskset): the
# worker on core 0, Valkey and the bench client on core 1. Commands run inside scripts
# (the publish script's HSET, XADD, HMGET per delta) are counted too; round trips are the
# top-level ones (EVALSHA, XREADGROUP, SREM, XACK, XDEL, ...).
#
#   docs/commandstats.sh [small|bench] [more mlxq bench flags]     (REQ=256 OUT=128 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-small}; shift || true
bin=.venv/bin
model=~/.cache/mlxq/pinned-$size
[ -d "$model" ] || $bin/mlxq demo-model --size "$([ "$size" = small ] && echo demo || echo bench)" "$model" >/dev/null
port=$($bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
data=$(mktemp -d)
export MKL_NUM_THREADS=1
taskset -c 1 $bin/mlxq redis --port "$port" --dir "$data" >"$data/valkey.log" 2>&1 &
worker=""
cleanup() {
  [ -n "$worker" ] && kill "$worker" 2>/dev/null && wait "$worker" 2>/dev/null
  $bin/mlxq redis stop --port "$port" >/dev/null 2>&1 || true
  rm -rf "$data"
}
trap cleanup EXIT
until $bin/python -c "import redis; redis.Redis(port=$port).ping()" 2>/dev/null; do sleep 0.2; done
taskset -c 0 $bin/python -m mlxq worker --redis-url "redis://127.0.0.1:$port" --queue commandstats \
  --model "$model" --max-num-seqs 16 --log-format json >"$data/worker.log" 2>&1 &
worker=$!
until grep -q '"worker ready"' "$data/worker.log"; do
  kill -0 "$worker" 2>/dev/null || { cat "$data/worker.log"; exit 1; }
  sleep 0.2
done
$bin/python -c "import redis; redis.Redis(port=$port).config_resetstat()"
taskset -c 1 $bin/mlxq bench --redis-url "redis://127.0.0.1:$port" --queue commandstats --model "$model" \
  --requests "${REQ:-256}" --concurrency 16 --input-len 100 --output-len "${OUT:-128}" --seed 5 "$@"
$bin/python - "$port" <<'PY'
import sys

import redis

stats = redis.Redis(port=int(sys.argv[1])).info("commandstats")
for name, row in sorted(stats.items(), key=lambda item: -item[1]["calls"]):
    print(f"{name.removeprefix('cmdstat_'):28s} {row['calls']:8d} calls  {row['usec_per_call']:8.2f} us a call")
PY
