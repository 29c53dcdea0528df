"""Speculative decoding inside mlx-lm's running batch: drafts from a `Proposer`
(prompt lookup, `prompt_lookup.py`; a draft model, `draft_model.py`), verified together.

One forward pass over every row's pending token and its draft verifies all drafts at
once; a greedy row keeps the draft tokens the model would have chosen itself and the
model's own token after them, so its output is the same token for token. A greedy row
with logits processors (penalties, a constraint's mask, min_tokens) verifies its draft
through them, position by position while the draft agrees, so they see exactly the
tokens accepted. Rows that sample (no acceptance rule for sampling is built: their
distribution stays exactly as without speculation) or asked for logprobs, and requests
that opt out, take one token as in any step: they verify nothing.

A step is speculative only when some row has a draft and the gate says speculation
pays at this batch size: it times epochs of steps taken each way (from one step to the
next, so the engine's own work counts), per batch-size bucket, keeps the faster (speculation by a margin), and
tries the other again after a patience that doubles each time the try loses (a try
running well below plain's rate is cut short). On a CPU
the verifying pass costs what its tokens cost and speculation stops paying at a few
rows; on a GPU decode is bound by memory and it pays further (docs/benchmarks.md).

The positions of rejected draft tokens are dropped from each row's KV cache as mlx-lm
drops a prefill's right padding (`BatchKVCache.prepare(right_padding=...)` then
`finalize()`: rolled into the row's left padding, masked from then on). That roll moves
every row's whole cache, so a speculative step costs more as contexts grow (the gate's
measurements see it; a cache whose rows each keep their own end would not need it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache


@dataclass
class SpeculationStats:
    """What speculation did since the worker started (vLLM's spec-decode counters)."""

    steps: int = 0  # speculative steps
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the model agreed with
    rows: int = 0  # sequences stepped in speculative steps
    emitted: int = 0  # tokens out of speculative steps (pending ones included)

    def as_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "draft_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None,
                "tokens_per_sequence_step": round(self.emitted / self.rows, 2) if self.rows else None}


EPOCH = 8  # steps taken one way before the gate chooses again
# Epochs at a batch size before the way the gate does not take is tried again: doubled
# each time the try confirms the choice, so a way that keeps losing costs less and less.
FIRST_PATIENCE, MAX_PATIENCE = 4, 256
SMOOTHING = 0.3  # weight of the newest epoch in each way's tokens-per-second average
# How much faster speculation must have measured to be chosen: epochs of one way and the
# other run at different moments, and a machine's speed drifts between them (here by more
# than 10 % within a minute), so a near tie is noise, and plain is what never loses to it.
MARGIN = 0.15
CUT_SHORT_AFTER, CUT_SHORT_BELOW = 4, 0.8  # steps into a speculative epoch, and the share of plain's rate


class Gate:
    """Whether to speculate at a batch size: whichever way has made more tokens per
    second at that size, measured on this machine as the batch runs (speculation by
    MARGIN at least).

    It chooses for an epoch of EPOCH steps and times steps 2 to EPOCH of it: the first
    carries what the way before left (a plain step's forward pass runs on while the next
    step begins), which counts a plain epoch's last token early, in plain's favour."""

    def __init__(self, adaptive: bool = True) -> None:
        self.adaptive = adaptive  # False: always speculate (tests, the upper bound)
        self._rates: dict[tuple[int, bool], float] = {}  # (batch-size bucket, speculative) -> tokens/s
        self._waited: dict[int, int] = {}  # epochs since the other way was tried, by bucket
        self._patience: dict[int, int] = {}
        self._exploring: int | None = None  # the bucket whose current epoch tries the other way
        self._bucket, self._way, self._step = 0, False, EPOCH + 1  # no epoch yet
        self._timed_from, self._tokens = 0.0, 0

    def choose(self, rows: int, now: float) -> bool:
        """The way of the step beginning `now` with `rows` sequences."""
        if not self.adaptive:
            return True
        bucket = rows.bit_length()  # 1, 2-3, 4-7, 8-15, ...
        if self._step >= EPOCH or bucket != self._bucket or self._clearly_losing(now):
            self._close(now)
            self._bucket, self._way, self._step = bucket, self._pick(bucket), 0
        self._step += 1
        if self._step == 2:
            self._timed_from, self._tokens = now, 0
        return self._way

    def took(self, tokens: int, speculative: bool) -> None:
        """The step just chosen gave `tokens` (`speculative`: it did speculate)."""
        if self._step >= 2:
            self._tokens += tokens
        if self._way and not speculative:  # no draft anywhere: the epoch's time is not speculation's
            self._step = EPOCH + 1

    def _clearly_losing(self, now: float) -> bool:
        """Whether a speculative epoch already runs well below plain's rate: cut short, so
        a try where speculation does not pay costs a few steps, not an epoch."""
        plain = self._rates.get((self._bucket, False))
        if not self._way or plain is None or not CUT_SHORT_AFTER <= self._step <= EPOCH:
            return False
        return self._tokens / max(now - self._timed_from, 1e-6) < CUT_SHORT_BELOW * plain

    def _close(self, now: float) -> None:
        if self._step < 3 or self._step > EPOCH:
            return
        key = (self._bucket, self._way)
        rate = self._tokens / max(now - self._timed_from, 1e-6)
        old = self._rates.get(key)
        self._rates[key] = rate if old is None else old + SMOOTHING * (rate - old)

    def _pick(self, bucket: int) -> bool:
        speculative, plain = self._rates.get((bucket, True)), self._rates.get((bucket, False))
        if speculative is None and self._loses_below(bucket):  # speculation pays less as batches grow
            if plain is None:
                return False
            speculative = 0.0  # until it is tried here
        if speculative is None or plain is None:
            return plain is not None  # each way measured once first, plain first: a losing try is cut short
        faster = speculative > plain * (1 + MARGIN)
        patience = self._patience.get(bucket, FIRST_PATIENCE)
        if self._exploring == bucket:  # the epoch just closed tried the other way
            self._exploring = None
            patience = FIRST_PATIENCE if faster == self._way else min(2 * patience, MAX_PATIENCE)
            self._patience[bucket] = patience
        waited = self._waited[bucket] = self._waited.get(bucket, 0) + 1
        if waited < patience:
            return faster
        self._waited[bucket], self._exploring = 0, bucket
        return not faster

    def _loses_below(self, bucket: int) -> bool:
        """Whether speculation was measured slower at a smaller batch size."""
        return any(self._rates[(b, True)] < self._rates[(b, False)] for b in range(1, bucket)
                   if (b, True) in self._rates and (b, False) in self._rates)

    def as_json(self) -> dict[str, Any]:
        """Tokens per second by batch size and way, as measured."""
        return {f"{'spec' if way else 'plain'}@{2 ** (bucket - 1)}+": round(rate)
                for (bucket, way), rate in sorted(self._rates.items())}


class Proposer(Protocol):
    """Where drafts come from; told of every change to the batch's rows."""

    method: str  # vLLM's name for it, for the heartbeat

    def drafts(self, batch: SpeculativeGenerationBatch, pending: list[int], room: list[int]) -> list[list[int]]:
        """Each row's draft (at most `room[row]` tokens; [] for none) to follow its
        pending token."""
        ...

    def verified(self, batch: SpeculativeGenerationBatch, accepted: list[int]) -> None:
        """The drafts just proposed were verified: row i kept its first `accepted[i]`."""
        ...

    def extended(self, batch: SpeculativeGenerationBatch, first_new: int) -> None:
        """Rows from `first_new` on joined the batch (prefilled, their first token pending)."""
        ...

    def filtered(self, batch: SpeculativeGenerationBatch) -> None:
        """The batch just dropped rows (those left keep their order)."""
        ...


class SpeculativeGenerationBatch(GenerationBatch):
    """mlx-lm's generation batch, speculating for the rows in `eligible`.

    Set up on an empty batch (`GenerationBatch.empty`), it is the one long-lived batch
    that BatchGenerator extends with each newly prefilled group of rows."""

    num_draft_tokens: int
    eligible: set[int]  # uids that may speculate (greedy, no logprobs, not opted out)
    stats: SpeculationStats

    def configure(self, proposer: Proposer, num_draft_tokens: int, eligible: set[int], stats: SpeculationStats,
                  gate: Gate) -> SpeculativeGenerationBatch:
        self.proposer, self.num_draft_tokens, self.eligible = proposer, num_draft_tokens, eligible
        self.stats, self.gate = stats, gate
        return self

    def next(self) -> list[GenerationBatch.Response]:
        if not self.uids or not self.eligible or not all(isinstance(c, BatchKVCache) for c in self.prompt_cache):
            return super().next()
        speculative = self.gate.choose(len(self.uids), time.perf_counter())
        responses = self._speculative_next() if speculative else None
        if responses is None:
            speculative, responses = False, super().next()
        self.gate.took(len(responses), speculative)
        return responses

    def extend(self, batch: GenerationBatch) -> None:
        first_new = len(self.uids)
        super().extend(batch)
        self.proposer.extended(self, first_new)

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        self.proposer.filtered(self)

    def _speculative_next(self) -> list[GenerationBatch.Response] | None:
        """A step verifying each eligible row's draft; None when no row has one."""
        pending = cast(list[int], self._next_tokens.tolist())
        # The pending token goes out too, so a row has room for one token fewer.
        room = [min(self.num_draft_tokens, most - done - 1) for most, done in zip(self.max_tokens, self._num_tokens,
                                                                                   strict=True)]
        drafts = self.proposer.drafts(self, pending, room)
        return self._verify(pending, drafts) if any(drafts) else None

    def _verify(self, pending: list[int], drafts: list[list[int]]) -> list[GenerationBatch.Response]:
        """One pass over each row's pending token and draft; each row keeps what it accepts."""
        width = max(len(d) for d in drafts)
        inputs = mx.array([[p, *d, *[p] * (width - len(d))] for p, d in zip(pending, drafts, strict=True)],
                          dtype=self._next_tokens.dtype)
        logits = self.model(inputs, cache=self.prompt_cache)
        first = self._processed(logits[:, 0, :])
        first_logprobs = first - mx.logsumexp(first, axis=-1, keepdims=True)
        sampled = self._sample(first_logprobs)
        targets = mx.argmax(logits[:, 1:, :], axis=-1)
        mx.eval(sampled, targets)
        chosen, after = cast(list[int], sampled.tolist()), cast(list[list[int]], targets.tolist())
        choices = [[c, *a] for c, a in zip(chosen, after, strict=True)]
        processed: dict[int, mx.array] = {}  # rows whose processors chose: the logits of their last choice
        for row, processors in enumerate(self.logits_processors or []):
            if processors and drafts[row]:
                choices[row], processed[row] = self._processed_choices(row, processors, logits[row], drafts[row],
                                                                       chosen[row])
        accepted = [_accepted(d, c) for d, c in zip(drafts, choices, strict=True)]
        next_tokens = [c[n] for c, n in zip(choices, accepted, strict=True)]
        drop_last(self.prompt_cache, [width - n for n in accepted])
        self.proposer.verified(self, accepted)
        last_logprobs = self._next_logprobs
        rows = mx.arange(len(pending))
        drawn_from = logits[rows, mx.array(accepted)]
        drawn_from = drawn_from - mx.logsumexp(drawn_from, axis=-1, keepdims=True)
        self._next_tokens = mx.array(next_tokens, dtype=self._next_tokens.dtype)
        self._next_logprobs = [first_logprobs[i] if n == 0 else drawn_from[i] for i, n in enumerate(accepted)]
        for row, last in processed.items():
            if accepted[row]:
                self._next_logprobs[row] = last - mx.logsumexp(last, axis=-1)
        emitted = [[p, *d[:n]] for p, d, n in zip(pending, drafts, accepted, strict=True)]
        for row_tokens, out in zip(self.tokens, emitted, strict=True):
            row_tokens.extend(out)
        self._count(drafts, accepted, emitted)
        return self._responses(emitted, last_logprobs)

    def _processed(self, logits: mx.array) -> mx.array:
        """The pending position's logits through each row's processors, as mlx-lm's step does."""
        by_row: list[Any] = self.logits_processors or []
        if not any(by_row):
            return logits
        rows = []
        for e, processors in enumerate(by_row):
            row = logits[e:e + 1]
            if processors:
                context = self._token_context[e].update_and_fetch(self._next_tokens[e:e + 1])
                for processor in processors:
                    row = processor(context, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def _processed_choices(self, row: int, processors: list[Any], logits: mx.array, draft: list[int],
                           first: int) -> tuple[list[int], mx.array]:
        """A row's greedy choices through its processors (penalties, a constraint's mask,
        min_tokens): `first` after its pending token, then one after each draft token as
        long as the draft agrees, so the processors see exactly the tokens accepted, as
        they would one step at a time; and the logits of the last choice."""
        choices, last = [first], logits[0]
        for position, token in enumerate(draft, start=1):
            if token != choices[-1]:
                break
            context = self._token_context[row].update_and_fetch(mx.array([token], dtype=self._next_tokens.dtype))
            last = logits[position:position + 1]
            for processor in processors:
                last = processor(context, last)
            last = last[0]
            choices.append(cast(int, mx.argmax(last).item()))
        return choices, last

    def _sample(self, logprobs: mx.array) -> mx.array:
        given: list[Any] = self.samplers or [None] * len(self.uids)
        samplers = [self.fallback_sampler if s is None else s for s in given]
        if all(s is samplers[0] for s in samplers):
            return samplers[0](logprobs)
        return mx.concatenate([s(logprobs[e:e + 1]) for e, s in enumerate(samplers)], axis=0)

    def _count(self, drafts: list[list[int]], accepted: list[int], emitted: list[list[int]]) -> None:
        self.stats.steps += 1
        self.stats.drafted += sum(len(d) for d in drafts)
        self.stats.accepted += sum(accepted)
        self.stats.rows += len(emitted)
        self.stats.emitted += sum(len(e) for e in emitted)

    def _responses(self, emitted: list[list[int]], last_logprobs: list[mx.array]) -> list[GenerationBatch.Response]:
        """One response per token out, in order; a row's last carries its end, as in `next`."""
        keep, responses = [], []
        for i, tokens in enumerate(emitted):
            finish_reason = None
            for j, token in enumerate(tokens):
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish_reason = "length"
                if self._matchers[i].advance(token):
                    finish_reason = "stop"
                last = finish_reason is not None or j == len(tokens) - 1
                responses.append(self.Response(
                    uid=self.uids[i], token=token, logprobs=last_logprobs[i] if j == 0 else None,  # type: ignore[arg-type]
                    finish_reason=finish_reason if last else None,
                    prompt_cache=self.extract_cache(i) if finish_reason else None,
                    all_tokens=self.tokens[i] if finish_reason else None))
                if finish_reason is not None:
                    break
            if finish_reason is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def drop_last(caches: list[Any], counts: list[int]) -> None:
    """Take each row's last `counts[row]` positions out of a batch's caches (a layer each)."""
    common = min(counts)
    rest = [n - common for n in counts]
    for cache in caches:
        if common:
            cache.trim(common)
        if any(rest):
            cache.prepare(right_padding=rest)
            cache.finalize()


def _accepted(draft: list[int], targets: list[int]) -> int:
    """How many of the draft's tokens lead the model's own choices (`targets[j]` is what
    it chose after the pending token and the draft's first j)."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n
