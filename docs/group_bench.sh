#!/usr/bin/env bash
# A two-rank worker group (tensor parallel, localhost, ring) against one process on the
# same model: 32 requests of 100 + 64 tokens at concurrency 16, through Redis, pairs
# alternated. MKL on one thread in every process: one process uses one core for the
# model, the group one core per rank.
#
#   docs/group_bench.sh [small|bench] [PAIRS]      # JSON under docs/bench/group-<size>-*
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-bench}; pairs=${2:-2}
bin=.venv/bin
export MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
model=~/.cache/mlxq/pinned-$size
[ -d "$model" ] || $bin/mlxq demo-model --size "$([ "$size" = small ] && echo demo || echo bench)" "$model" >/dev/null
port=$($bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url=redis://127.0.0.1:$port
work=$(mktemp -d)
$bin/mlxq redis --port "$port" --dir "$work" >/dev/null 2>&1 &
until $bin/python -c "import redis; redis.Redis(port=$port).ping()" 2>/dev/null; do sleep 0.2; done
running=""
cleanup() { [ -n "$running" ] && kill "$running" 2>/dev/null; $bin/mlxq redis stop --port "$port" >/dev/null 2>&1 || true; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
ready() { until grep -q '"worker ready"' "$1"; do kill -0 "$running" || { cat "$1"; exit 1; }; sleep 0.2; done; }
bench() { $bin/mlxq bench --redis-url "$url" --queue "$1" --requests 32 --concurrency 16 --input-len 100 \
            --output-len 64 --seed 3 --json "$2" >/dev/null 2>&1; }
for p in $(seq "$pairs"); do
  $bin/python -m mlxq worker --redis-url "$url" --queue one --model "$model" --log-format json >"$work/one.log" 2>&1 &
  running=$!; ready "$work/one.log"; bench one "docs/bench/group-$size-one-$p.json"; kill "$running"; wait "$running" || true
  setsid bash -c "sleep 100000 | $bin/mlx.launch --hosts 127.0.0.1 -n 2 --backend ring -- $PWD/$bin/python -m mlxq \
    worker --redis-url $url --queue group --model $model --log-format json --distributed tensor \
    --group-port $((port + 1))" >"$work/group.log" 2>&1 &  # an open stdin: the launcher spins less
  running=$!; ready "$work/group.log"; bench group "docs/bench/group-$size-group-$p.json"
  kill -TERM -- -"$running"; wait "$running" || true
done
running=""
$bin/python - "$size" "$pairs" <<'PY'
import json, sys
size, pairs = sys.argv[1], int(sys.argv[2])
for p in range(1, pairs + 1):
    one, group = (json.load(open(f"docs/bench/group-{size}-{k}-{p}.json"))["throughput_tok_s"] for k in ("one", "group"))
    print(f"pair {p}: one process {one:.1f} tok/s, two-rank group {group:.1f} tok/s: {group / one:.3f}")
PY
