"""Turns each step's tokens into output events: the one place that makes deltas.

Per request: mlx-lm's streaming detokenizer (never splits a UTF-8 sequence), stop
strings found in the text and cut from it, text that could still become a stop string
held back, and deltas coalesced every `stream_interval` tokens (and, while the engine
holds running streams' tokens between flushes, until the next flush). The concatenated delta
texts always equal the terminal `text`. On a thinking model, the tokens between the
reasoning markers go through a second detokenizer into `reasoning`, never into `text`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from client.protocol import Delta, Done, ErrorCode, Event, FinishReason, Timing, TokenLogprob, Usage
from worker.engine.backends import TokenOut
from worker.engine.tools import parse_tool_calls
from worker.messages import EngineRequest, Outgoing, Resume, failed


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 1)


class RequestOutput:
    """The output side of one running request."""

    def __init__(self, request: EngineRequest, detokenizer: Any, admitted_at: float,
                 reasoning_detokenizer: Any = None) -> None:
        self.request = request
        self.detokenizer = detokenizer
        self.reasoning_detokenizer = reasoning_detokenizer  # with `request.reporting.thinking`
        self.in_thought = request.reporting.thinking is not None and request.reporting.thinking.open
        self.answered = False  # a token of the answer came: a reasoning marker is text from now on
        self.reasoning_sent = 0  # characters of the reasoning already in deltas
        self.admitted_at = admitted_at
        self.first_token_at: float | None = None
        self.text = ""  # visible text so far: the detokenized text, cut at a stop string
        self.sent = 0  # characters of `text` already in deltas
        self.pending: list[int] = []  # token ids not yet in a delta
        self.pending_logprobs: list[TokenLogprob] = []  # theirs, when the request asked for logprobs
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.last_token_at: float | None = None
        self.seq = 0
        self.done: Done | None = None
        self.stop_reason: str | None = None  # the stop string that ended the text
        self._hold = max((len(s) for s in request.stopping.stop), default=1) - 1
        if request.resume is not None:
            self._replay(request.resume)

    def _replay(self, resume: Resume) -> None:
        """Take up where an earlier delivery stopped: its tokens are in the detokenizer and
        the text it sent is not sent again (text it held back still may be)."""
        for token in resume.tokens:
            self._take(token)
        self.completion_tokens = len(resume.tokens)
        self.seq = resume.deltas
        self._update_text()
        self.sent = len(resume.text)
        self.reasoning_sent = len(resume.reasoning)

    def _take(self, token: int) -> None:
        """Into the reasoning or the text; the reasoning markers into neither."""
        thinking = self.request.reporting.thinking
        where = "text"
        if thinking is not None:
            where, self.in_thought = thinking.place(token, self.in_thought, self.answered)
        if where == "reasoning":
            self.reasoning_detokenizer.add_token(token)
        elif where == "text":
            self.answered = True
            self.detokenizer.add_token(token)

    @property
    def reasoning(self) -> str | None:
        """The reasoning so far, on a thinking model."""
        return None if self.request.reporting.thinking is None else self.reasoning_detokenizer.text

    def add(self, out: TokenOut, now: float, logprob: TokenLogprob | None = None, flush: bool = True) -> list[Event]:
        """Take one generated token (and its logprob, when asked for); returns the events it
        completes. Without `flush`, the tokens wait for a later delta, unless this is the
        first (a reader waits for it most) or the request ends."""
        if self.first_token_at is None:
            self.first_token_at = now
        if out.cached_tokens is not None:
            self.cached_tokens = out.cached_tokens
        self.last_token_at = now
        # A stop token (eos unless ignore_eos, stop_token_ids) is not output.
        stopped = out.finish_reason == "stop" or out.token in self.request.stopping.stop_tokens
        if not stopped:
            self._take(out.token)
            self.pending.append(out.token)
            if logprob is not None:
                self.pending_logprobs.append(logprob)
            self.completion_tokens += 1
        if stopped or out.finish_reason is not None:
            self.detokenizer.finalize()
            if self.reasoning_detokenizer is not None:
                self.reasoning_detokenizer.finalize()
        if self._update_text() or stopped:
            return self.finish("stop", now)
        if out.finish_reason is not None:
            return self.finish("length", now)
        if len(self.pending) >= self.request.reporting.stream_interval and (flush or self.seq == 0):
            return [self._delta(len(self.text) - self._held_back())]
        return []

    def finish(self, reason: FinishReason, now: float) -> list[Event]:
        """End the request: flush what is left as a last delta, then `done`."""
        events: list[Event] = []
        if self.pending or self.sent < len(self.text) or self.reasoning_sent < len(self.reasoning or ""):
            events.append(self._delta(len(self.text)))
        tool_calls = parse_tool_calls(self.text, tools) if (tools := self.request.reporting.tools) else None
        self.done = Done(
            id=self.request.id,
            finish_reason="tool_calls" if tool_calls and reason == "stop" else reason,
            text=self.text,
            usage=Usage(len(self.request.prompt_tokens), self.completion_tokens, self.cached_tokens),
            timing=self._timing(now),
            metadata=self.request.queueing.metadata,
            tool_calls=tool_calls or None,
            reasoning=self.reasoning,
            stop_reason=self.stop_reason,
        )
        return [*events, self.done]

    def _update_text(self) -> bool:
        """Refresh `text` from the detokenizer; True if a stop string appeared (and was cut
        there, or after it with `include_stop`). None is looked for before `min_tokens`."""
        full = self.detokenizer.text
        start = max(0, len(self.text) - self._hold)
        stopping = self.request.stopping
        stops = stopping.stop if self.completion_tokens >= stopping.min_tokens else []
        hits = [(i, i + len(s)) for i, s in ((full.find(s, start), s) for s in stops) if i >= 0]
        if not hits:
            self.text = full
            return False
        at, end = min(hits)
        self.text = full[:end] if self.request.stopping.include_stop else full[:at]
        self.stop_reason = full[at:end]
        return True

    def _held_back(self) -> int:
        """Length of the text's tail that could still grow into a stop string."""
        for size in range(min(self._hold, len(self.text) - self.sent), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self.request.stopping.stop):
                return size
        return 0

    def _delta(self, upto: int) -> Delta:
        reasoning = self.reasoning
        delta = Delta(id=self.request.id, seq=self.seq, text=self.text[self.sent:upto], tokens=self.pending,
                      logprobs=None if self.request.reporting.logprobs is None else self.pending_logprobs,
                      reasoning=None if reasoning is None else reasoning[self.reasoning_sent:])
        self.reasoning_sent = len(reasoning or "")
        self.seq += 1
        self.sent = upto
        self.pending, self.pending_logprobs = [], []
        return delta

    def _timing(self, now: float) -> Timing:
        """Queue time, time to first token and total from arrival; then, over this run's
        tokens after the first, mean inter-token latency and tokens per second."""
        arrived, first, last = self.request.queueing.arrived_at, self.first_token_at, self.last_token_at
        resumed = len(self.request.resume.tokens) if self.request.resume else 0
        after_first = self.completion_tokens - resumed - 1
        decoding = None if first is None or last is None or after_first < 1 else last - first
        return Timing(
            queued_ms=_ms(self.admitted_at - arrived),
            ttft_ms=None if first is None else _ms(first - arrived),
            total_ms=_ms(now - arrived),
            itl_ms=None if not decoding else _ms(decoding / after_first),
            tok_s=None if not decoding else round(after_first / decoding, 1),
        )  # the stages before and after the engine are the request table's (`HeldRequest.timed`)


def process_step(outputs: dict[int, RequestOutput], tokens: Iterable[TokenOut], now: float,
                 logprobs: Mapping[int, TokenLogprob] | None = None,
                 flush: bool = True) -> tuple[list[Outgoing], list[int]]:
    """Events for one step's tokens (with the logprobs of those whose request asked),
    and the uids of the sequences that finished; without `flush`, only first deltas and
    ends (see `RequestOutput.add`)."""
    outgoing: list[Outgoing] = []
    finished: list[int] = []
    for out in tokens:
        output = outputs.get(out.uid)
        if output is None or output.done is not None:  # removed this step (cancelled), or ended by an earlier
            continue  # token of this step (a speculative step's tokens after a stop): the token is dropped
        try:
            events = output.add(out, now, (logprobs or {}).get(out.uid), flush)
        except Exception as e:  # noqa: BLE001 - this request alone fails
            outgoing.append(failed(output.request.ref, ErrorCode.INTERNAL, f"could not turn tokens into text: {e!r}"))
            finished.append(out.uid)
            continue
        outgoing.extend(Outgoing(output.request.ref, event) for event in events)
        if output.done is not None:
            finished.append(out.uid)
    return outgoing, finished
