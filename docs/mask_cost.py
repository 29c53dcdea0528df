"""The cost of structured output's masks per batch step, by vocabulary size.

For each model, 16 matchers of the bench's JSON schema (mlxq/bench.py) advance together
over sampled tokens; each step fills all 16 masks in one parallel call (as the worker
does) and applies them to a (16, vocab) logits array. Prints milliseconds per step.

    .venv/bin/python docs/mask_cost.py MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import random
import sys
import time

import mlx.core as mx
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par
from mlx_lm.utils import load_tokenizer

from client.protocol import validate_body
from mlxq.bench import RESPONSE_FORMATS
from worker.engine.constraints import Grammars, apply_bitmask, format_grammar

ROWS, STEPS = 16, 200


def measure(path: str) -> tuple[int, float, float]:
    tokenizer = load_tokenizer(path)
    vocab = len(tokenizer._tokenizer)
    grammars = Grammars(tokenizer, vocab)
    body = validate_body({"prompt": "x", "response_format": RESPONSE_FORMATS["json"]})
    grammar = format_grammar(body.response_format)
    matchers = [grammars.matcher(grammar, []) for _ in range(ROWS)]
    bitmask, executor, rng = allocate_token_bitmask(ROWS, vocab), LLExecutor(), random.Random(0)
    logits = mx.random.normal((ROWS, vocab))
    fill_s = apply_s = 0.0
    for _ in range(STEPS):
        started = time.perf_counter()
        fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        fill_s += time.perf_counter() - started
        started = time.perf_counter()
        masked = apply_bitmask(logits, bitmask)
        mx.eval(masked)
        apply_s += time.perf_counter() - started
        chosen = mx.argmax(masked + mx.random.normal(masked.shape), axis=-1).tolist()
        for matcher, token in zip(matchers, chosen, strict=True):
            assert matcher.consume_token(token), matcher.get_error()
    return vocab, 1000 * fill_s / STEPS, 1000 * apply_s / STEPS


if __name__ == "__main__":
    assert LLMatcher
    print(f"{'vocab':>8} {'fill ms/step':>13} {'apply ms/step':>14}  ({ROWS} rows)")
    for model in sys.argv[1:]:
        vocab, fill_ms, apply_ms = measure(model)
        print(f"{vocab:>8} {fill_ms:>13.2f} {apply_ms:>14.2f}")
