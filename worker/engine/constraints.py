"""Constrained decoding with llguidance: a request's `response_format` made a matcher at
intake (off the engine thread: compiling can take a while), and the logits processor
that masks every token the matcher would refuse, on the engine thread.

JSON is compiled with strict whitespace: with llguidance's default (flexible) whitespace a
weak model (the random demo model, and real ones now and then) emits spaces until
`max_tokens`. The matcher allows
eos once the text is complete, and eos is a stop token, so a constrained request ends by
itself when its answer is whole.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import mlx.core as mx
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

from client.protocol import (
    ChoiceFormat,
    ErrorCode,
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    RegexFormat,
    RequestRejected,
)
from worker.messages import Thinking

JSON_OPTIONS = {"whitespace_flexible": False}
# Compiling a grammar is bounded by llguidance's own limits (fuel, grammar size), so a
# hostile schema costs a bounded time at intake; past them the request is `too_large`.
LIMITS = LLParserLimits()
LIMIT_WORDS = ("limit", "fuel", "too large", "too many", "exceeded")


class Grammars:
    """Compiles response formats for one model's tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        from llguidance.hf import from_tokenizer

        self.vocab_size = vocab_size
        self.tokenizer: LLTokenizer = from_tokenizer(tokenizer._tokenizer, n_vocab=vocab_size,
                                                     eos_token=sorted(tokenizer.eos_token_ids))

    def matcher(self, grammar: str, generated: list[int]) -> LLMatcher:
        """A matcher for the grammar (see `format_grammar`), advanced over tokens an earlier
        delivery already streamed; raises `RequestRejected` with llguidance's reason."""
        problem = LLMatcher.validate_grammar(grammar, self.tokenizer, limits=LIMITS)
        if problem:
            raise _rejected(problem)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise _rejected(matcher.get_error())
        if generated and not matcher.consume_tokens(generated):
            raise RequestRejected(f"response_format: the output streamed before does not match it "
                                  f"({_one_line(matcher.get_error())})", code=ErrorCode.INTERNAL)
        return matcher


def format_grammar(response_format: Any) -> str:
    """llguidance's grammar for a request's `response_format`."""
    if isinstance(response_format, JsonObjectFormat):
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if isinstance(response_format, JsonSchemaFormat):
        try:
            return LLMatcher.grammar_from_json_schema(response_format.json_schema.schema_,
                                                      defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as e:
            raise _rejected(str(e)) from None
    if isinstance(response_format, RegexFormat):
        return LLMatcher.grammar_from_regex(response_format.pattern)
    if isinstance(response_format, ChoiceFormat):
        alternatives = " | ".join(json.dumps(choice) for choice in response_format.choices)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert isinstance(response_format, GrammarFormat)
    return LLMatcher.grammar_from_lark(response_format.lark)


def _rejected(problem: str) -> RequestRejected:
    text = _one_line(problem)
    code = ErrorCode.TOO_LARGE if any(word in text.lower() for word in LIMIT_WORDS) else ErrorCode.INVALID_REQUEST
    return RequestRejected(f"response_format: {text}", code=code)


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()[:500]


class Guides:
    """The constrained sequences of the batch, on the engine thread: one shared bitmask
    (a row each), filled for all of them in one call before a step (llguidance's
    parallel fill, off the GIL), from each sequence's next input token as the backend
    reports it. A sequence the backend could not report (its first step after prefill)
    fills its own row when its processor runs."""

    def __init__(self, vocab_size: int, rows: int) -> None:
        self.vocab_size = vocab_size
        self.bitmask = allocate_token_bitmask(rows, vocab_size)
        self.executor = LLExecutor()
        self._free = list(range(rows - 1, -1, -1))
        self._by_uid: dict[int, GuidedProcessor] = {}
        self.fills = 0  # batch fills done, and the seconds they took (the mask's cost)
        self.fill_s = 0.0

    def __bool__(self) -> bool:
        return bool(self._by_uid)

    def processor(self, matcher: LLMatcher, consumed: int, eos: list[int],
                  thinking: Thinking | None) -> GuidedProcessor:
        """A processor with a row of the shared bitmask; `attach` it once its sequence has a uid."""
        return GuidedProcessor(matcher, consumed, self, self._free.pop(), eos, thinking)

    def attach(self, uid: int, processor: GuidedProcessor) -> None:
        self._by_uid[uid] = processor

    def release(self, uid: int) -> None:
        processor = self._by_uid.pop(uid, None)
        if processor is not None:
            self.discard(processor)

    def discard(self, processor: GuidedProcessor) -> None:
        """Give back the row of a processor whose sequence ended (or never started)."""
        self._free.append(processor.row)

    def prefill(self, upcoming: dict[int, int]) -> None:
        """Feed each guided sequence the token its next step appends, and fill every mask
        that step needs in one call."""
        targets = [(p.matcher, p.row) for uid, token in upcoming.items()
                   if (p := self._by_uid.get(uid)) is not None and p.feed_ahead(token)]
        if targets:
            started = time.perf_counter()
            fill_next_token_bitmask_par(self.executor, targets, self.bitmask)
            self.fill_s += time.perf_counter() - started
            self.fills += 1


class GuidedProcessor:
    """Masks the logits of one sequence to what its matcher accepts next. Engine thread.

    It sees the sequence's tokens (the prompt's `consumed` first) and feeds the matcher
    those it has not seen, unless `Guides.prefill` fed it and filled its row already. On
    a thinking model the constraint waits for the reasoning to end: free inside it
    (`thinking.open`), and before the first token it also allows the reasoning to start.
    It never raises: a step that raised would fail the whole batch. A matcher in error
    (which the mask should make impossible) allows only eos, which ends the request."""

    def __init__(self, matcher: LLMatcher, consumed: int, guides: Guides, row: int, eos: list[int],
                 thinking: Thinking | None = None) -> None:
        self.matcher = matcher
        self.consumed = consumed
        self.guides = guides
        self.row = row
        self.ahead = False  # fed the next step's token already (that step has not run yet)
        self.filled = False  # and the shared row holds the mask for it
        self.eos = mx.array(eos)
        self.thinking = thinking
        self.phase = "answer" if thinking is None else "think" if thinking.open else "may think"

    def feed_ahead(self, token: int) -> bool:
        """Take the token the next step appends (once); True if that step needs a mask filled."""
        if self.ahead:
            return False
        self._feed([token])
        self.consumed += 1
        self.ahead = True
        self.filled = self._masking()
        return self.filled

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """mlx-lm's call: every token of the sequence so far."""
        if len(tokens) > self.consumed:
            self._feed(tokens[self.consumed:].tolist())  # type: ignore[arg-type]
            self.consumed = len(tokens)
            self.filled = False
        return self._mask(logits)

    def process_last_token(self, last_token: int, logits: mx.array) -> mx.array:
        """mlx-vlm's call in decoding: the token just appended (its prefill calls `__call__`
        with the prompt)."""
        if not self.ahead:
            self._feed([last_token])
            self.consumed += 1
            self.filled = False
        return self._mask(logits)

    def _mask(self, logits: mx.array) -> mx.array:
        filled, self.filled, self.ahead = self.filled, False, False
        if self.phase == "think":
            return logits
        if self.matcher.is_error() or self.matcher.is_stopped():
            only_eos = mx.full(logits.shape, -mx.inf, dtype=logits.dtype)
            only_eos[:, self.eos] = 0
            return only_eos
        if not filled:
            fill_next_token_bitmask(self.matcher, self.guides.bitmask, self.row)
        masked = apply_bitmask(logits, self.guides.bitmask[self.row:self.row + 1])
        if self.phase == "may think" and self.thinking is not None:
            masked[:, self.thinking.start] = logits[:, self.thinking.start]
        return masked

    def _masking(self) -> bool:
        return self.phase != "think" and not (self.matcher.is_error() or self.matcher.is_stopped())

    def _feed(self, tokens: list[int]) -> None:
        answer = []
        for token in tokens:
            if self.phase == "may think":
                assert self.thinking is not None
                self.phase = "think" if token == self.thinking.start else "answer"
                if self.phase == "think":
                    continue
            if self.phase == "think":
                assert self.thinking is not None
                if token == self.thinking.end:
                    self.phase = "answer"
                continue
            answer.append(token)
        if answer:
            self.matcher.consume_tokens(answer)


def apply_bitmask(logits: mx.array, bitmask: Any) -> mx.array:
    """`logits` where the bitmask (32 tokens per int32 word) allows, -inf elsewhere.
    llguidance's MLX kernel is Metal-only; this runs on any backend."""
    words = mx.array(bitmask)
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    allowed = bits.reshape(words.shape[0], -1)[:, : logits.shape[-1]].astype(mx.bool_)
    return mx.where(allowed, logits, -mx.inf)
