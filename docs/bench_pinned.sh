#!/usr/bin/env bash
# The worker's own cost per step, measured with the model on a core of its own (Linux:
# taskset; on macOS there is no pinning, run mlxq bench as docs/benchmarks.md shows).
#
#   core 0: the worker's engine process (named by `engine_pid` in its heartbeat), alone,
#           MKL single-threaded
#   core 1: everything else: the worker's I/O process, Valkey, the bench client; the
#           in-process baselines run on core 0 (`--baseline-cpus 0`), one thread of MKL,
#           while the worker waits, so the model has the same core to itself either way
#   (A worker from before the engine had a process of its own has no `engine_pid`: the
#   whole worker goes on core 0, as this script did then.)
#
#   docs/bench_pinned.sh small          # the small demo model (the tests' model): ~2.6 ms steps
#   docs/bench_pinned.sh bench          # the bench model: ~50 ms steps
#   MODE=backlog docs/bench_pinned.sh small   # every request at once against a batch as wide as the worker
#   MODE=c16 docs/bench_pinned.sh bench       # concurrency 16 only, against raw and detokenizing
#   docs/bench_pinned.sh small --json docs/bench/x.json --stream-interval 16   # more bench flags
#   PINNED=0 docs/bench_pinned.sh small # the same processes, unpinned (both cores for all)
#   WORKER_TREE=/tmp/old docs/bench_pinned.sh small  # the worker from another checkout (before/after)
#
# It builds the model once under ~/.cache/mlxq, starts its own Valkey and worker on free
# ports, runs the workload and the three baselines, and stops what it started.
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:?small or bench}; shift
bin=.venv/bin
model=~/.cache/mlxq/pinned-$size
[ -d "$model" ] || $bin/mlxq demo-model --size "$([ "$size" = small ] && echo demo || echo bench)" "$model" >/dev/null
port=$($bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
queue=pinned-$$
if [ "${PINNED:-1}" = 1 ]; then on_rest="taskset -c 1"; else on_rest=""; fi
export MKL_NUM_THREADS=1
data=$(mktemp -d)
$on_rest $bin/mlxq redis --port "$port" --dir "$data" >"$data/valkey.log" 2>&1 &
valkey=$!
worker=""
cleanup() {
  [ -n "$worker" ] && kill "$worker" 2>/dev/null && wait "$worker" 2>/dev/null
  $bin/mlxq redis stop --port "$port" >/dev/null 2>&1 || kill "$valkey" 2>/dev/null
  wait "$valkey" 2>/dev/null || true
  rm -rf "$data"
}
trap cleanup EXIT
until $bin/python -c "import redis, sys; redis.Redis(port=$port).ping()" 2>/dev/null; do sleep 0.2; done
worker_bin=$PWD/$bin
(cd "${WORKER_TREE:-.}" && exec $on_rest "$worker_bin/python" -m mlxq worker --redis-url "redis://127.0.0.1:$port" --queue "$queue" --model "$model" \
  --max-num-seqs 16 --log-format json) >"$data/worker.log" 2>&1 &
worker=$!
until grep -q '"worker ready"' "$data/worker.log"; do
  kill -0 "$worker" 2>/dev/null || { cat "$data/worker.log"; exit 1; }
  sleep 0.2
done
if [ "${PINNED:-1}" = 1 ]; then
  engine=$($bin/python -c "import json, redis, sys
r = redis.Redis(port=$port)
beats = [json.loads(r.get(k)) for k in r.scan_iter('mlxq:workers:*')]
print(next((b.get('engine_pid') for b in beats if b.get('queue') == '$queue'), None) or '')")
  taskset -a -pc 0 "${engine:-$worker}" >/dev/null  # every thread of it: MLX's stream threads too
fi
if [ "${MODE:-closed}" = backlog ]; then
  mode=(--backlog --baseline inprocess)
elif [ "${MODE:-closed}" = c16 ]; then  # the batch alone (a long model's sequential baseline takes minutes)
  mode=(--concurrency 16 --baseline inprocess --baseline detokenizing)
else
  mode=(--concurrency 1,16 --baseline inprocess --baseline detokenizing --baseline sequential)
fi
# Pinned, the baselines run on core 0 too (the worker idles meanwhile): the same core as
# the engine process, whose speed here is not core 1's.
if [ "${PINNED:-1}" = 1 ]; then mode+=(--baseline-cpus 0); fi
$on_rest $bin/mlxq bench --redis-url "redis://127.0.0.1:$port" --queue "$queue" --model "$model" \
  --requests 64 --input-len 100 --output-len 128 "${mode[@]}" "$@"
