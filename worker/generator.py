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
class TokenOut:
    """One sequence's token from one decode step; `finish_reason` is set on its last."""

    uid: int
    token: int
    finish_reason: str | None  # "stop" (an eos id) | "length" | None


class BatchBackend(Protocol):
    """What the engine needs from a continuous-batching generator."""

    def insert(self, prompt: list[int], max_tokens: int, sampler: Sampler,
               logits_processors: list[LogitsProcessor]) -> int: ...

    def remove(self, uids: Iterable[int]) -> None: ...

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
               logits_processors: list[LogitsProcessor]) -> int:
        (uid,) = self._generator.insert([prompt], max_tokens=[max_tokens], samplers=[sampler],
                                        logits_processors=[logits_processors], stop_sequences=[self._eos])
        return uid

    def remove(self, uids: Iterable[int]) -> None:
        self._generator.remove(list(uids))

    def step(self) -> list[TokenOut]:
        _, generated = self._generator.next()
        return [TokenOut(r.uid, r.token, r.finish_reason) for r in generated]

    def close(self) -> None:
        self._generator.close()
