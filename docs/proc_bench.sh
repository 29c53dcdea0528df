#!/usr/bin/env bash
# Alternated before/after pairs for the engine process (before: a worktree of 316e30f at
# /tmp/before45, where the engine is a thread: git worktree add /tmp/before45 316e30f).
cd "$(dirname "$0")/.."
out=docs/bench
run() { # name env... -- args
  local name=$1; shift
  echo "=== $name $(date +%T)"
  env "$@" 2>&1 | grep -E "through Redis|TTFT p50|^redis|^inprocess|^detok|^sequential" | head -12
}
for i in 1 2 3; do
  run small-closed-p1-before-$i WORKER_TREE=/tmp/before45 docs/bench_pinned.sh small --seed $((700+i)) --json $out/proc-small-closed-p1-before-$i.json
  run small-closed-p1-after-$i docs/bench_pinned.sh small --seed $((700+i)) --json $out/proc-small-closed-p1-after-$i.json
  run small-backlog-p1-before-$i MODE=backlog WORKER_TREE=/tmp/before45 docs/bench_pinned.sh small --seed $((710+i)) --json $out/proc-small-backlog-p1-before-$i.json
  run small-backlog-p1-after-$i MODE=backlog docs/bench_pinned.sh small --seed $((710+i)) --json $out/proc-small-backlog-p1-after-$i.json
done
for i in 1 2; do
  run small-closed-p0-before-$i PINNED=0 WORKER_TREE=/tmp/before45 docs/bench_pinned.sh small --seed $((720+i)) --json $out/proc-small-closed-p0-before-$i.json
  run small-closed-p0-after-$i PINNED=0 docs/bench_pinned.sh small --seed $((720+i)) --json $out/proc-small-closed-p0-after-$i.json
  run small-backlog-p0-before-$i PINNED=0 MODE=backlog WORKER_TREE=/tmp/before45 docs/bench_pinned.sh small --seed $((730+i)) --json $out/proc-small-backlog-p0-before-$i.json
  run small-backlog-p0-after-$i PINNED=0 MODE=backlog docs/bench_pinned.sh small --seed $((730+i)) --json $out/proc-small-backlog-p0-after-$i.json
  run bench-c16-p1-before-$i MODE=c16 WORKER_TREE=/tmp/before45 docs/bench_pinned.sh bench --requests 32 --seed $((740+i)) --json $out/proc-bench-c16-p1-before-$i.json
  run bench-c16-p1-after-$i MODE=c16 docs/bench_pinned.sh bench --requests 32 --seed $((740+i)) --json $out/proc-bench-c16-p1-after-$i.json
  run bench-backlog-p1-before-$i MODE=backlog WORKER_TREE=/tmp/before45 docs/bench_pinned.sh bench --requests 64 --seed $((750+i)) --json $out/proc-bench-backlog-p1-before-$i.json
  run bench-backlog-p1-after-$i MODE=backlog docs/bench_pinned.sh bench --requests 64 --seed $((750+i)) --json $out/proc-bench-backlog-p1-after-$i.json
done
echo "=== done $(date +%T)"
