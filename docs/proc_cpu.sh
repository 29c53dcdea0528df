#!/usr/bin/env bash
# CPU seconds of the I/O process and of the engine process per generated token, one bench run (small model, pinned).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin; model=~/.cache/mlxq/pinned-small; port=16411; queue=cpu-$$
export MKL_NUM_THREADS=1
data=$(mktemp -d)
taskset -c 1 $bin/mlxq redis --port $port --dir $data >/dev/null 2>&1 &
until $bin/python -c "import redis; redis.Redis(port=$port).ping()" 2>/dev/null; do sleep 0.2; done
taskset -c 1 $bin/python -m mlxq worker --redis-url redis://127.0.0.1:$port --queue $queue --model $model --log-format json > $data/w.log 2>&1 &
worker=$!
until grep -q '"worker ready"' $data/w.log; do sleep 0.2; done
engine=$(grep -o '"engine_pid": [0-9]*' $data/w.log | head -1 | grep -o '[0-9]*$')
taskset -a -pc 0 $engine >/dev/null
cpu() { awk '{print ($14+$15)/100}' /proc/$1/stat; }
$bin/mlxq bench --redis-url redis://127.0.0.1:$port --queue $queue --requests 16 --concurrency 16 --input-len 100 --output-len 16 --seed 1 >/dev/null 2>&1  # warm
io0=$(cpu $worker); en0=$(cpu $engine)
taskset -c 1 $bin/mlxq bench --redis-url redis://127.0.0.1:$port --queue $queue --requests ${REQUESTS:-128} --concurrency ${C:-16} --input-len 100 --output-len 128 --seed 2 --json $data/b.json >/dev/null 2>&1
io1=$(cpu $worker); en1=$(cpu $engine)
tokens=$($bin/python -c "import json; print(json.load(open('$data/b.json'))['runs'][0]['tokens'])")
tps=$($bin/python -c "import json; print(json.load(open('$data/b.json'))['throughput_tok_s'])")
$bin/python -c "print(f'tokens $tokens at $tps tok/s: I/O process {($io1-$io0)/$tokens*1e6:.1f} us/token, engine process {($en1-$en0)/$tokens*1e6:.1f} us/token')"
kill $worker; wait $worker 2>/dev/null || true
$bin/mlxq redis stop --port $port >/dev/null 2>&1 || true
rm -rf $data
