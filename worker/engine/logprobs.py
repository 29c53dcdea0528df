"""Each generated token's log probability and its top alternatives, from the batch's own
log-softmax rows. Runs on the engine thread (MLX arrays), once per step for every
request of the step that asked: one gather, one partial sort, one transfer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import mlx.core as mx

from client.protocol import TokenLogprob, TopLogprob
from worker.engine.backends import TokenOut

UNLIKELY = -9999.0  # what a -inf logprob is sent as (JSON has no infinity; OpenAI sends the same)


def token_logprobs(tokens: Iterable[TokenOut], wanted: Mapping[int, int], tokenizer: Any) -> dict[int, TokenLogprob]:
    """For each token whose sequence asked (`wanted`: uid -> alternatives, 0-20), its
    logprob and its top alternatives, most likely first."""
    asked = [t for t in tokens if t.uid in wanted and t.logprobs is not None]
    if not asked:
        return {}
    rows = mx.stack([t.logprobs.reshape(-1) for t in asked])
    chosen = mx.take_along_axis(rows, mx.array([[t.token] for t in asked]), axis=-1)[:, 0]
    k = max(wanted[t.uid] for t in asked)
    ids: list[list[int]] = [[] for _ in asked]
    values: list[list[float]] = [[] for _ in asked]
    if k:
        top_ids = mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(rows, top_ids, axis=-1)
        mx.eval(chosen, top_ids, top_values)
        ids, values = top_ids.tolist(), top_values.tolist()  # type: ignore[assignment]
    picked: list[float] = chosen.tolist()  # type: ignore[assignment]
    result = {}
    for token, logprob, row_ids, row_values in zip(asked, picked, ids, values, strict=True):
        ranked = sorted(zip(row_values, row_ids, strict=True), key=lambda pair: -pair[0])[:wanted[token.uid]]
        result[token.uid] = TokenLogprob(
            token_id=token.token, text=tokenizer.decode([token.token]), logprob=_finite(logprob),
            top_logprobs=[TopLogprob(token_id=i, text=tokenizer.decode([i]), logprob=_finite(v)) for v, i in ranked])
    return result


def _finite(value: float) -> float:
    return value if math.isfinite(value) else UNLIKELY
