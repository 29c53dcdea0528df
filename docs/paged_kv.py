"""Paged-KV decision: what sharing a 512-token prefix would save, and what it would cost per step.

    python docs/paged_kv.py /tmp/bench-model      (see docs/benchmarks.md)
"""

import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

ROWS, PREFIX = 16, 512


def active_mb() -> float:
    return mx.get_active_memory() / 2**20


model, _ = load(sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench-model")
generator = BatchGenerator(model, stop_tokens=None, completion_batch_size=ROWS, prefill_batch_size=ROWS)
base = active_mb()
prefix = list(range(100, 100 + PREFIX))
generator.insert([prefix + [700 + i] for i in range(ROWS)], max_tokens=[64] * ROWS)
for _ in range(8):
    generator.next()
print(f"active memory with {ROWS} rows of a {PREFIX}-token shared prefix: +{active_mb() - base:.0f} MB")

started = time.perf_counter()
for _ in range(20):
    generator.next()
print(f"decode step at {ROWS} x ~{PREFIX + 8} tokens: {(time.perf_counter() - started) / 20 * 1e3:.1f} ms")

# What a paged layout adds each step: gathering the shared blocks into every row's contiguous K/V.
args = model.args
layers, heads, dim = args.num_hidden_layers, args.num_key_value_heads, args.head_dim
shared = mx.random.normal((1, heads, PREFIX, dim))
mx.eval(shared)
started = time.perf_counter()
for _ in range(20):
    rows = [mx.broadcast_to(shared, (ROWS, heads, PREFIX, dim)) * 1 for _ in range(2 * layers)]
    mx.eval(rows)
print(f"materialising the shared prefix into {ROWS} rows (K and V, {layers} layers): "
      f"{(time.perf_counter() - started) / 20 * 1e3:.1f} ms per step")
print(f"KV bytes per token: {2 * layers * heads * dim * 4} (float32); Qwen3-0.6B in bf16: {28 * 2 * 8 * 128 * 2}")
