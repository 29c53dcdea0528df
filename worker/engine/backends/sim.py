"""A simulated engine for fleet-scale runs: the real worker, queue and protocol, with a
batch backend that sleeps instead of computing. Only for `mlxq worker --model sim:...`
in fleet simulations (`python -m mlxq.fleet_sim`); everything else runs the real model.

    sim:step_ms=25,slots=64    one decode step takes 25 ms for up to 64 sequences

Tokens are deterministic: sequence i of a prompt yields (sum(prompt) + i) % 26, shown
as the letters a-z, so any reader can check its text.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Any

from worker.engine.backends.base import Coverage, Loaded, ModelInfo, TokenOut
from worker.engine.scheduler import StepPlan
from worker.messages import PreparedMedia


class SimBackend:
    """`BatchBackend` that takes `step_s` per step for up to `slots` sequences."""

    def __init__(self, step_s: float, slots: int) -> None:
        self.step_s = step_s
        self.slots = slots
        self._uids = itertools.count()
        self._running: dict[int, list[int]] = {}  # uid -> [next token, left, seed]

    def insert(self, prompt: list[int], max_tokens: int, sampler: Any, logits_processors: Any,
               cached: Coverage | None = None, media: PreparedMedia | None = None, logprobs: bool = False,
               speculative: bool = True, cache_salt: str = "", adapter: int = 0) -> int:
        assert adapter == 0, "a simulated model serves no adapters"
        uid = next(self._uids)
        self._running[uid] = [0, max_tokens, sum(prompt) + (len(cached.tokens) if cached else 0)]
        return uid

    def remove(self, uids: Iterable[int], keep_caches: bool = False) -> dict[int, Coverage]:
        for uid in uids:
            self._running.pop(uid, None)
        return {}

    def step(self, plan: StepPlan) -> list[TokenOut]:
        time.sleep(self.step_s)
        outs = []
        for uid, state in list(self._running.items())[: self.slots]:
            index, left, seed = state
            state[0], state[1] = index + 1, left - 1
            outs.append(TokenOut(uid, (seed + index) % 26, "length" if left == 1 else None))
            if left == 1:
                del self._running[uid]
        return outs

    def upcoming_tokens(self) -> dict[int, int]:
        return {}

    def running_cache(self, uid: int) -> Coverage | None:
        return None

    def close(self) -> None:
        self._running.clear()


class Letters:
    """Tokenizer and detokenizer of the simulation: token t is the letter chr(97 + t % 26)."""

    has_chat_template = False

    def __init__(self) -> None:
        self.text = ""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 26 for c in text]

    def add_token(self, token: int) -> None:
        self.text += chr(97 + token % 26)

    def finalize(self) -> None:
        pass


def load_sim(spec: str, name: str | None = None) -> Loaded:
    """The simulated model described by `spec` (see the module docstring), named `name`
    (default: `spec`); also what a worker answering `unavailable` runs, loading nothing."""
    options = dict(part.split("=", 1) for part in spec.removeprefix("sim:").split(",") if part)
    step_s, slots = float(options.get("step_ms", 25)) / 1000, int(options.get("slots", 64))
    info = ModelInfo(name=name or spec, tokenizer=Letters(), context_length=1_000_000, vocab_size=1_000_000,
                     logprobs=False)
    return Loaded(info=info, make_backend=lambda: SimBackend(step_s, slots), new_detokenizer=Letters)
