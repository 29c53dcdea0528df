"""Constrained decoding with llguidance: a request's `response_format` made a matcher at
intake (off the engine thread: compiling can take a while), and the logits processor
that masks every token the matcher would refuse, on the engine thread.

JSON is compiled with strict whitespace: with llguidance's default (flexible) whitespace a
weak model can emit spaces until `max_tokens` (see ../shared/FACTS.md). The matcher allows
eos once the text is complete, and eos is a stop token, so a constrained request ends by
itself when its answer is whole.
"""

from __future__ import annotations

import json
import re
from typing import Any

import mlx.core as mx
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from client.protocol import (
    ChoiceFormat,
    ErrorCode,
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    RegexFormat,
    RequestRejected,
)

from .messages import Thinking

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


class GuidedProcessor:
    """Masks the logits of one sequence to what its matcher accepts next. Engine thread.

    It sees the sequence's tokens (the prompt's `consumed` first) and feeds the matcher
    those it has not seen. On a thinking model the constraint waits for the reasoning to
    end: free inside it (`thinking.open`), and before the first token it also allows the
    reasoning to start. It never raises: a step that raised would fail the whole batch.
    A matcher in error (which the mask should make impossible) allows only eos, which
    ends the request."""

    def __init__(self, matcher: LLMatcher, consumed: int, vocab_size: int, eos: list[int],
                 thinking: Thinking | None = None) -> None:
        self.matcher = matcher
        self.consumed = consumed
        self.bitmask = allocate_token_bitmask(1, vocab_size)
        self.eos = mx.array(eos)
        self.thinking = thinking
        self.phase = "answer" if thinking is None else "think" if thinking.open else "may think"

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if len(tokens) > self.consumed:
            self._feed(tokens[self.consumed:].tolist())  # type: ignore[arg-type]
            self.consumed = len(tokens)
        if self.phase == "think":
            return logits
        if self.matcher.is_error() or self.matcher.is_stopped():
            only_eos = mx.full(logits.shape, -mx.inf, dtype=logits.dtype)
            only_eos[:, self.eos] = 0
            return only_eos
        fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        masked = apply_bitmask(logits, self.bitmask)
        if self.phase == "may think" and self.thinking is not None:
            masked[:, self.thinking.start] = logits[:, self.thinking.start]
        return masked

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
