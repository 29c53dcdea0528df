"""Turns a request entry into an `EngineRequest`, or an error that says what is wrong.

Runs off the engine thread: it only encodes with the tokenizer and checks limits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from client.keys import Keys
from client.pooling import pooling_kind
from client.protocol import Encoding, Envelope, ErrorCode, RequestBody, RequestRejected, encode_metadata, validate_body
from common.prefix_chain import prefix_chain
from worker.engine.backends import ModelInfo
from worker.engine.constraints import Grammars, format_grammar
from worker.engine.tools import forced_call_grammar
from worker.faults import NONE, Faults
from worker.messages import (
    EngineRequest,
    PreparedMedia,
    Queueing,
    Reporting,
    RequestRef,
    Resume,
    SamplingParams,
    Stopping,
    Thinking,
    ToolFormat,
    ToolUse,
)
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = structlog.get_logger("mlxq.worker")


class Preparer:
    """Validates and tokenizes requests against one model and one worker's limits."""

    def __init__(self, info: ModelInfo, settings: WorkerSettings, faults: Faults = NONE,
                 refusal: str | None = None) -> None:
        self.info = info
        self.settings = settings
        self.faults = faults
        self.refusal = refusal  # every request answered with it (`Hosting.refusal`)
        self.keys = Keys(settings.prefix)
        self.queue = settings.queue
        self.prompt_token_limit = min(settings.max_prompt_tokens or info.context_length, info.context_length)
        self.longest_token = longest_token(info.tokenizer)
        self.eos_ids = frozenset(getattr(info.tokenizer, "eos_token_ids", None) or ())
        self.grammars = _grammars(info)

    def prepare(self, envelope: Envelope, ref: RequestRef, arrived_at: float,
                clock_offset_s: float, resume: Resume | None = None) -> EngineRequest:
        """An engine request; raises `RequestRejected` with the field and the reason."""
        if envelope.error is not None:
            raise envelope.error
        if self.refusal is not None:
            raise RequestRejected(self.refusal, code=ErrorCode.MODEL_UNAVAILABLE)
        assert envelope.raw is not None
        try:
            body = validate_body(envelope.raw)
        except RequestRejected as e:
            if pooling_kind(envelope.raw) is None:
                raise
            raise RequestRejected(f"this queue's model ({self.info.name}) generates text; embeddings and rerank "
                                  f"go to the queue of an embedding model or a reranker ({e})") from e
        self.faults.exit_if_marked(body.prompt)
        problem = None if body.reply_to is None else self.keys.reply_to_problem(self.queue, body.reply_to)
        if problem:
            raise RequestRejected(problem)
        self._check_stop(body.stop)
        if body.logprobs and not self.info.logprobs:
            raise RequestRejected(f"logprobs: this worker's model ({self.info.name}) does not give them yet")
        self._check_token_ids(body)
        tools = self._tool_use(body)
        if body.metadata is not None:
            check_metadata(body.metadata, envelope.encoding, self.settings.max_metadata_bytes)
        max_tokens = self._max_tokens(body)
        self._check_prompt_size(body)
        tokens, media = self._tokenize_with_media(body) if body.has_media else (self._tokenize(body), None)
        room = self._check_prompt_length(tokens)
        thinking = self._thinking(tokens)
        constraint = self._constraint(body, tools, _answer_tokens(resume, thinking))
        return EngineRequest(
            ref=ref,
            prompt_tokens=tokens,
            sampling=SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=body.seed,
                                    presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                    logit_bias=body.logit_bias),  # type: ignore[arg-type]  # keys made ints
            stopping=Stopping(
                max_tokens=0 if body.count_only else min(max_tokens, room), stop=body.stop,
                stop_tokens=frozenset(body.stop_token_ids) | (frozenset() if body.ignore_eos else self.eos_ids),
                min_tokens=self._min_tokens(body, max_tokens), include_stop=body.include_stop_str_in_output),
            queueing=Queueing(
                priority=body.priority, arrived_at=arrived_at,
                deadline_at=None if body.deadline_ms is None else body.deadline_ms / 1000.0 - clock_offset_s,
                metadata=body.metadata),
            reporting=Reporting(stream_interval=body.stream_interval or self.settings.stream_interval,
                                logprobs=(body.top_logprobs or 0) if body.logprobs else None, tools=tools,
                                thinking=thinking),
            resume=resume,
            media=media,
            constraint=constraint,
            speculative=body.speculative,
            cache_salt=body.cache_salt or "",
            adapter=body.adapter or "",
            prefix_chain=prefix_chain(envelope.raw),
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
        chars = len(body.prompt or "") + sum(len(m.text) for m in body.messages or [])
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

    def _thinking(self, prompt: list[int]) -> Thinking | None:
        """The model's reasoning markers, if it has single-token ones, and whether the
        prompt ends inside a reasoning block (a template that opens it)."""
        tokenizer = self.info.tokenizer
        if not getattr(tokenizer, "has_thinking", False):
            return None
        starts: tuple[int, ...] = tokenizer.think_start_tokens or ()
        ends: tuple[int, ...] = tokenizer.think_end_tokens or ()
        if len(starts) != 1 or len(ends) != 1:  # multi-token markers: not separated (yet)
            return None
        start, end = starts[0], ends[0]
        last_start = max((i for i, t in enumerate(prompt) if t == start), default=-1)
        last_end = max((i for i, t in enumerate(prompt) if t == end), default=-1)
        return Thinking(start, end, open=last_start > last_end)

    def _tool_use(self, body: RequestBody) -> ToolUse | None:
        """The tools the output may call (None without tools, or with tool_choice none)."""
        if not body.tools or body.tool_choice == "none":
            return None
        fmt = ToolFormat.of(self.info.tokenizer)
        if fmt is None:
            raise RequestRejected(f"tools: this model's chat template ({self.info.name}) has no tool-call format "
                                 "mlx-lm can read")
        return ToolUse(fmt, [tool.model_dump(exclude_none=True) for tool in body.tools])

    def _constraint(self, body: RequestBody, tools: ToolUse | None, answered: list[int]) -> LLMatcher | None:
        """The request's compiled response_format, or the grammar of a forced tool call
        (None for neither)."""
        forced = tools is not None and body.tool_choice not in (None, "auto")
        if body.response_format is None and not forced:
            return None
        what = "response_format" if body.response_format is not None else "tool_choice"
        if self.grammars is None:
            raise RequestRejected(f"{what}: this worker's model ({self.info.name}) cannot be constrained yet")
        for field in ("ignore_eos", "min_tokens"):
            if getattr(body, field):
                raise RequestRejected(f"{field} cannot be combined with {what}: it decides where the output ends")
        if body.response_format is not None:
            grammar = format_grammar(body.response_format)
        else:
            assert tools is not None and body.tools is not None and body.tool_choice is not None
            grammar = forced_call_grammar(tools.format, body.tools, body.tool_choice)  # type: ignore[arg-type]
        return self.grammars.matcher(grammar, answered)

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

    def _tokenize_with_media(self, body: RequestBody) -> tuple[list[int], PreparedMedia]:
        if self.info.vision is None:
            raise RequestRejected(f"{body.first_media_field}: this queue serves a text-only model ({self.info.name})")
        return self.info.vision.prepare(body, template_kwargs(body))

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
            return self._render_chat(body)
        assert body.prompt is not None
        tokens = list(tokenizer.encode(body.prompt))
        if not tokens:
            raise RequestRejected("prompt: encodes to no tokens")
        return tokens


    def _render_chat(self, body: RequestBody) -> list[int]:
        """The chat template's tokens for the messages, the tools and the request's
        chat_template_kwargs (`template_kwargs`)."""
        kwargs = template_kwargs(body)
        messages = [{**m.model_dump(exclude_none=True), **({"content": m.text} if m.content is not None else {})}
                    for m in body.messages or []]  # a text model's template takes text: parts joined
        try:
            tokens = self.info.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template that fails on this request fails the request
            raise RequestRejected(f"messages: the model's chat template failed on them ({ascii(str(e)[:300])})") from e
        return list(tokens)


def check_metadata(metadata: dict[str, object], encoding: Encoding, limit: int) -> None:
    """Metadata is echoed in `done`: refuse now what could not be written then."""
    try:
        size = len(encode_metadata(metadata, encoding))
    except (TypeError, ValueError, RecursionError) as e:
        raise RequestRejected(f"metadata: cannot be sent back as {encoding} ({ascii(str(e)[:200])})") from e
    if size > limit:
        raise RequestRejected(f"metadata: {size} bytes encoded is above this worker's max_metadata_bytes ({limit})",
                              code=ErrorCode.TOO_LARGE)


def template_kwargs(body: RequestBody) -> dict[str, Any]:
    """What the chat template gets beside the messages: the request's
    chat_template_kwargs and the tools (unless tool_choice is none)."""
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = RESERVED_TEMPLATE_KWARGS & set(kwargs)
    if reserved:
        raise RequestRejected(f"chat_template_kwargs: {', '.join(sorted(reserved))} cannot be set by a request")
    if body.tools and body.tool_choice != "none":
        kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    return kwargs


def _answer_tokens(resume: Resume | None, thinking: Thinking | None) -> list[int]:
    """The tokens of the answer (after any reasoning) an earlier delivery already streamed:
    what a constraint's matcher must be advanced over."""
    tokens = resume.tokens if resume else []
    return tokens if thinking is None else thinking.after(tokens)[1]


# What apply_chat_template takes that would change what it returns, or whose template it runs.
RESERVED_TEMPLATE_KWARGS = frozenset({"tokenize", "return_dict", "return_tensors", "add_generation_prompt", "tools",
                                      "messages", "conversation", "chat_template", "documents", "padding",
                                      "truncation", "max_length", "continue_final_message",
                                      "return_assistant_tokens_mask",
                                      # mlx-vlm's chat formatting's own arguments (image requests)
                                      "processor", "config", "prompt", "return_messages", "num_images",
                                      "num_audios", "model_name", "role", "skip_image_token",
                                      "skip_audio_token", "video", "fps", "max_pixels", "audio_token"})


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
    """What compiles response formats for this model: one whose tokenizer is a Hugging
    Face fast tokenizer; None for the others (simulated), which refuse them."""
    if not hasattr(info.tokenizer, "_tokenizer"):
        return None
    try:
        return Grammars(info.tokenizer, info.vocab_size)
    except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read costs constraints, not the worker
        log.warning("response_format and forced tool calls are off: llguidance cannot read this tokenizer",
                    model=info.name, error=repr(e))
        return None
