"""mlx-lm's BatchGenerator behind a small interface.

Its API moves between minor releases, so only this module touches it; the engine and
its tests see `BatchBackend`, which a fake can implement without a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import LogitsProcessor, Sampler


@dataclass(frozen=True)
class Coverage:
    """A sequence's KV cache and exactly the tokens it covers (prompt and generated)."""

    cache: list[Any]
    tokens: list[int]


@dataclass(frozen=True)
class TokenOut:
    """One sequence's token from one decode step; `finish_reason` is set on its last,
    which also carries the sequence's cache when the backend gives it."""

    uid: int
    token: int
    finish_reason: str | None  # "stop" (an eos id) | "length" | None
    coverage: Coverage | None = None
    cached_tokens: int | None = None  # on a sequence's first token, from a backend that finds cached prefixes itself


class BatchBackend(Protocol):
    """What the engine needs from a continuous-batching generator."""

    def insert(self, prompt: list[int], max_tokens: int, sampler: Sampler,
               logits_processors: list[LogitsProcessor], cached: Coverage | None = None,
               images: list[Any] | None = None) -> int:
        """Start a sequence; with `cached`, `prompt` is what follows the tokens it covers;
        `images` (on a vision model) are those whose image tokens are in `prompt`."""
        ...

    def remove(self, uids: Iterable[int], keep_caches: bool = False) -> dict[int, Coverage]:
        """Stop sequences; with `keep_caches`, return their caches."""
        ...

    def step(self) -> list[TokenOut]: ...

    def close(self) -> None: ...


class MlxBatchBackend:
    """`BatchBackend` over mlx-lm 0.32's BatchGenerator."""

    def __init__(self, model: Any, eos_ids: Iterable[int], *, completion_batch_size: int,
                 prefill_batch_size: int, prefill_step_size: int) -> None:
        self._generator = BatchGenerator(model, completion_batch_size=completion_batch_size,
                                         prefill_batch_size=prefill_batch_size,
                                         prefill_step_size=prefill_step_size)
        # eos ends a sequence only when passed per request: stop_sequences replace the default.
        self._eos = StopSequences([[i] for i in sorted(eos_ids)])

    def insert(self, prompt: list[int], max_tokens: int, sampler: Sampler,
               logits_processors: list[LogitsProcessor], cached: Coverage | None = None,
               images: list[Any] | None = None) -> int:
        assert not images, "a text model takes no images"
        (uid,) = self._generator.insert([prompt], max_tokens=[max_tokens], samplers=[sampler],
                                        logits_processors=[logits_processors], stop_sequences=[self._eos],
                                        caches=None if cached is None else [cached.cache],
                                        all_tokens=None if cached is None else [cached.tokens])
        return uid

    def remove(self, uids: Iterable[int], keep_caches: bool = False) -> dict[int, Coverage]:
        caches = self._generator.remove(list(uids), return_prompt_caches=keep_caches)
        return {uid: Coverage(cache, list(tokens)) for uid, (cache, tokens) in (caches or {}).items()}

    def step(self) -> list[TokenOut]:
        _, generated = self._generator.next()
        return [TokenOut(r.uid, r.token, r.finish_reason,
                         None if r.prompt_cache is None else Coverage(r.prompt_cache, list(r.all_tokens)))
                for r in generated]

    def close(self) -> None:
        self._generator.close()
