"""Turns a request entry into an `EngineRequest`, or an error that says what is wrong.

Runs off the engine thread: it only encodes with the tokenizer and checks limits.
"""

from __future__ import annotations

from typing import Any

from client.keys import Keys
from client.protocol import Encoding, Envelope, ErrorCode, RequestBody, RequestRejected, encode_metadata, validate_body

from .backends import ModelInfo
from .constraints import Grammars
from .faults import NONE, Faults
from .images import PreparedImage
from .messages import EngineRequest, Resume, Route, SamplingParams
from .settings import WorkerSettings


class Preparer:
    """Validates and tokenizes requests against one model and one worker's limits."""

    def __init__(self, info: ModelInfo, settings: WorkerSettings, faults: Faults = NONE) -> None:
        self.info = info
        self.settings = settings
        self.faults = faults
        self.keys = Keys(settings.prefix)
        self.prompt_token_limit = min(settings.max_prompt_tokens or info.context_length, info.context_length)
        self.longest_token = longest_token(info.tokenizer)
        self.eos_ids = frozenset(getattr(info.tokenizer, "eos_token_ids", None) or ())
        self.grammars = _grammars(info)

    def prepare(self, envelope: Envelope, route: Route, arrived_at: float,
                clock_offset_s: float, resume: Resume | None = None) -> EngineRequest:
        """An engine request; raises `RequestRejected` with the field and the reason."""
        if envelope.error is not None:
            raise envelope.error
        assert envelope.raw is not None
        body = validate_body(envelope.raw)
        self.faults.exit_if_marked(body.prompt)
        problem = None if body.reply_to is None else self.keys.reply_to_problem(body.reply_to)
        if problem:
            raise RequestRejected(problem)
        self._check_stop(body.stop)
        if body.logprobs and not self.info.logprobs:
            raise RequestRejected(f"logprobs: this worker's model ({self.info.name}) does not give them yet")
        if body.ignore_eos and self.info.vision is not None:
            raise RequestRejected(f"ignore_eos: a vision model's batch ({self.info.name}) always stops at eos")
        self._check_token_ids(body)
        constraint = self._constraint(body, resume)
        if body.metadata is not None:
            self._check_metadata(body.metadata, envelope.encoding)
        max_tokens = self._max_tokens(body)
        self._check_prompt_size(body)
        tokens, images = self._tokenize_with_images(body) if body.images else (self._tokenize(body), None)
        room = self._check_prompt_length(tokens)
        return EngineRequest(
            route=route,
            prompt_tokens=tokens,
            max_tokens=min(max_tokens, room),
            sampling=SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=body.seed,
                                    presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                    logit_bias=body.logit_bias),  # type: ignore[arg-type]  # keys made ints
            stop=body.stop,
            stream_interval=body.stream_interval or self.settings.stream_interval,
            priority=body.priority,
            arrived_at=arrived_at,
            deadline_at=None if body.deadline_ms is None else body.deadline_ms / 1000.0 - clock_offset_s,
            metadata=body.metadata,
            resume=resume,
            images=images,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            stop_tokens=frozenset(body.stop_token_ids) | (frozenset() if body.ignore_eos else self.eos_ids),
            min_tokens=self._min_tokens(body, max_tokens),
            include_stop=body.include_stop_str_in_output,
            constraint=constraint,
        )

    def _check_prompt_length(self, tokens: list[int]) -> int:
        """The room left in the context after the prompt; the prompt must leave some."""
        limit = self.settings.max_prompt_tokens
        if limit is not None and len(tokens) > limit:
            raise RequestRejected(f"the prompt has {len(tokens)} tokens; this worker's max_prompt_tokens is {limit}",
                                 code=ErrorCode.TOO_LARGE)
        room = self.info.context_length - len(tokens)
        if room < 1:
            raise RequestRejected(f"the prompt has {len(tokens)} tokens; this model's context is "
                                 f"{self.info.context_length} tokens", code=ErrorCode.TOO_LARGE)
        return room

    def _check_prompt_size(self, body: RequestBody) -> None:
        """Refuse a prompt that cannot fit from its length alone, before tokenizing it (a
        token never spans more characters than the longest in the vocabulary)."""
        if self.longest_token is None:
            return
        chars = len(body.prompt or "") + sum(len(m.content) for m in body.messages or [])
        most = self.prompt_token_limit * self.longest_token
        if chars > most:
            raise RequestRejected(f"the prompt has {chars} characters: more than {self.prompt_token_limit} tokens "
                                 f"(this worker's limit: max_prompt_tokens or the model's context) can hold",
                                 code=ErrorCode.TOO_LARGE)

    def _check_stop(self, stop: list[str]) -> None:
        if len(stop) > self.settings.max_stop_strings:
            raise RequestRejected(f"stop: {len(stop)} strings is above this worker's max_stop_strings "
                                 f"({self.settings.max_stop_strings})", code=ErrorCode.TOO_LARGE)
        longest = max((len(s) for s in stop), default=0)
        if longest > self.settings.max_stop_length:
            raise RequestRejected(f"stop: a string of {longest} characters is above this worker's max_stop_length "
                                 f"({self.settings.max_stop_length})", code=ErrorCode.TOO_LARGE)

    def _check_metadata(self, metadata: dict[str, object], encoding: Encoding) -> None:
        """Metadata is echoed in `done`: refuse now what could not be written then."""
        try:
            size = len(encode_metadata(metadata, encoding))
        except (TypeError, ValueError, RecursionError) as e:
            raise RequestRejected(f"metadata: cannot be sent back as {encoding} ({ascii(str(e)[:200])})") from e
        if size > self.settings.max_metadata_bytes:
            raise RequestRejected(f"metadata: {size} bytes encoded is above this worker's max_metadata_bytes "
                                 f"({self.settings.max_metadata_bytes})", code=ErrorCode.TOO_LARGE)

    def _constraint(self, body: RequestBody, resume: Resume | None) -> Any:
        """The request's compiled response_format (None without one)."""
        if body.response_format is None:
            return None
        if self.grammars is None:
            raise RequestRejected(f"response_format: this worker's model ({self.info.name}) cannot be constrained yet")
        for field in ("ignore_eos", "min_tokens"):
            if getattr(body, field):
                raise RequestRejected(f"{field} cannot be combined with response_format: the format decides where "
                                     "the output ends")
        return self.grammars.matcher(body.response_format, resume.tokens if resume else [])

    def _check_token_ids(self, body: RequestBody) -> None:
        for field, ids in (("logit_bias", list(body.logit_bias or {})), ("stop_token_ids", body.stop_token_ids)):
            outside = [i for i in ids if int(i) >= self.info.vocab_size]
            if outside:
                raise RequestRejected(f"{field}: token ids {outside[:5]} are outside the vocabulary "
                                     f"(size {self.info.vocab_size})")

    def _min_tokens(self, body: RequestBody, max_tokens: int) -> int:
        if body.min_tokens > max_tokens:
            raise RequestRejected(f"min_tokens: {body.min_tokens} is above max_tokens ({max_tokens})")
        return body.min_tokens

    def _max_tokens(self, body: RequestBody) -> int:
        limit = self.settings.max_tokens_limit
        if body.max_tokens is None:
            return min(self.settings.default_max_tokens, limit)
        if body.max_tokens > limit:
            raise RequestRejected(f"max_tokens: {body.max_tokens} is above this worker's max_tokens_limit ({limit})",
                                 code=ErrorCode.TOO_LARGE)
        return body.max_tokens

    def _tokenize_with_images(self, body: RequestBody) -> tuple[list[int], list[PreparedImage]]:
        if self.info.vision is None:
            raise RequestRejected(f"images: this queue serves a text-only model ({self.info.name})")
        return self.info.vision.prepare(body)  # type: ignore[no-any-return]

    def _tokenize(self, body: RequestBody) -> list[int]:
        tokenizer = self.info.tokenizer
        if body.prompt_tokens is not None:
            bad = [t for t in body.prompt_tokens if t >= self.info.vocab_size]
            if bad:
                raise RequestRejected(f"prompt_tokens: ids {bad[:5]} are outside the vocabulary "
                                     f"(size {self.info.vocab_size})")
            return list(body.prompt_tokens)
        if body.messages is not None:
            if not getattr(tokenizer, "has_chat_template", False):
                raise RequestRejected("messages: this model has no chat template; send prompt or prompt_tokens")
            messages = [m.model_dump() for m in body.messages]
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        assert body.prompt is not None
        tokens = list(tokenizer.encode(body.prompt))
        if not tokens:
            raise RequestRejected("prompt: encodes to no tokens")
        return tokens


def longest_token(tokenizer: Any) -> int | None:
    """Characters in the longest token of the vocabulary (None if it cannot be listed).
    A byte-level BPE token's string has one character per byte it stands for, so a text
    of n characters has at least n / longest tokens."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        return max(map(len, get_vocab()), default=1)
    except Exception:  # noqa: BLE001 - a tokenizer without a listable vocabulary: no early check
        return None


def _grammars(info: ModelInfo) -> Grammars | None:
    """What compiles response formats for this model: text models whose tokenizer is a
    Hugging Face fast tokenizer; None for the others (vision, simulated), which refuse them."""
    if info.vision is not None or not hasattr(info.tokenizer, "_tokenizer"):
        return None
    return Grammars(info.tokenizer, info.vocab_size)
