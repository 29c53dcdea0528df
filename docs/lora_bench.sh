#!/usr/bin/env bash
# Four LoRA adapters mixed in one batch, against the same workload with no adapters, and
# against the four fused into models of their own served one after another (a worker each,
# loaded in turn): the bench model (~50 ms steps), 16 rows, engine process on core 0,
# everything else on core 1.
#
#   docs/lora_bench.sh [PAIRS] [RANK]        # default 3 pairs, rank 16; JSON under docs/bench/lora-<size>-*
#   SIZE=small docs/lora_bench.sh            # the small demo model (~2.6 ms steps) instead
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-3}; rank=${2:-16}
bin=.venv/bin
export MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
size=${SIZE:-bench}
model=~/.cache/mlxq/pinned-$size
[ -d "$model" ] || $bin/mlxq demo-model --size "$([ "$size" = small ] && echo demo || echo bench)" "$model" >/dev/null
work=$(mktemp -d)
names=(tone format lang sql)
adapters=(); flags=()
for i in 0 1 2 3; do
  $bin/mlxq demo-model --adapter "$work/${names[$i]}" --base "$model" --rank "$rank" --seed "$i" >/dev/null
  adapters+=("${names[$i]}=$work/${names[$i]}"); flags+=(--adapter "${names[$i]}")
done
port=$($bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url=redis://127.0.0.1:$port
taskset -c 1 $bin/mlxq redis --port "$port" --dir "$work" >/dev/null 2>&1 &
until $bin/python -c "import redis; redis.Redis(port=$port).ping()" 2>/dev/null; do sleep 0.2; done
worker=""
cleanup() { [ -n "$worker" ] && kill "$worker" 2>/dev/null; wait 2>/dev/null; $bin/mlxq redis stop --port "$port" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT

start_worker() {  # queue, model, worker flags...
  local queue=$1 served=$2; shift 2
  taskset -c 1 $bin/python -m mlxq worker --redis-url "$url" --queue "$queue" --model "$served" --max-num-seqs 16 \
    --log-format json "$@" >"$work/$queue.log" 2>&1 &
  worker=$!
  until grep -q '"worker ready"' "$work/$queue.log"; do kill -0 "$worker" || { cat "$work/$queue.log"; exit 1; }; sleep 0.2; done
  taskset -a -pc 0 "$(grep -o '"engine_pid": [0-9]*' "$work/$queue.log" | head -1 | grep -o '[0-9]*$')" >/dev/null
}
stop_worker() { kill "$worker"; wait "$worker" 2>/dev/null || true; worker=""; }
bench() {  # queue, requests, json, more flags
  local queue=$1 requests=$2 json=$3; shift 3
  taskset -c 1 $bin/mlxq bench --redis-url "$url" --queue "$queue" --requests "$requests" --concurrency 16 \
    --input-len 100 --output-len 128 --seed 7 --json "$json" "$@" >/dev/null 2>&1
}

start_worker mixed "$model" --adapter "${adapters[@]}"
bench mixed 16 "$work/warm.json" "${flags[@]}"
for p in $(seq "$pairs"); do
  bench mixed 64 "docs/bench/lora-$size-none-$p.json"
  bench mixed 64 "docs/bench/lora-$size-mixed-$p.json" "${flags[@]}"
done
stop_worker

started=$(date +%s.%N)  # the four as fused models, one worker after another, 16 requests each
for i in 0 1 2 3; do
  $bin/python -m mlx_lm fuse --model "$model" --adapter-path "$work/${names[$i]}" --save-path "$work/fused-$i" >/dev/null 2>&1
done
fused_started=$(date +%s.%N)
for i in 0 1 2 3; do
  start_worker "fused-$i" "$work/fused-$i"
  bench "fused-$i" 16 "docs/bench/lora-$size-fused-$i.json"
  stop_worker
done
ended=$(date +%s.%N)
$bin/python - "$pairs" "$fused_started" "$ended" "$started" "$size" <<'PY'
import json, statistics, sys
pairs, fused_started, ended, fuse_started, size = int(sys.argv[1]), *map(float, sys.argv[2:5]), sys.argv[5]
load = lambda path: json.load(open(path))
ratios, mixed_walls = [], []
for p in range(1, pairs + 1):
    none, mixed = load(f"docs/bench/lora-{size}-none-{p}.json"), load(f"docs/bench/lora-{size}-mixed-{p}.json")
    ratios.append(mixed["throughput_tok_s"] / none["throughput_tok_s"])
    mixed_walls.append(mixed["runs"][0]["elapsed_s"])
    print(f"pair {p}: no adapters {none['throughput_tok_s']:.1f} tok/s, four mixed {mixed['throughput_tok_s']:.1f} "
          f"tok/s: {ratios[-1]:.3f}")
print(f"mixed / none, median of {pairs}: {statistics.median(ratios):.3f}")
fused_tokens = sum(load(f"docs/bench/lora-{size}-fused-{i}.json")["runs"][0]["tokens"] for i in range(4))
print(f"four fused models in turn (each worker started, 16 requests, stopped): {ended - fused_started:.1f} s for "
      f"{fused_tokens} tokens, {fused_tokens / (ended - fused_started):.1f} tok/s (fusing them took "
      f"{fused_started - fuse_started:.1f} s more); four mixed in one batch: {statistics.median(mixed_walls):.1f} s "
      f"for 64 requests")
PY
