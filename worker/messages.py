"""Typed messages between the event loop (owns Redis) and the engine thread (owns MLX)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from client.protocol import (
    Done,
    Encoding,
    Envelope,
    Error,
    ErrorCode,
    Event,
    FinishReason,
    MediaKind,
    Task,
    Timing,
    Usage,
)

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass(frozen=True)
class PreparedMedia:
    """A request's media items, ready for the model's encoders: preparation (decoding,
    resizing, the model's processor) happens off the engine thread, with the placeholder
    tokens already in the prompt; the engine thread only runs the encoders on `inputs`,
    through the embedding cache under `key`."""

    # The embedding cache's key: the model, and each item's kind and content hash (and how
    # it was sampled) in the order the prompt holds them.
    key: str
    inputs: Mapping[str, Any]  # the processor's outputs but the token ids (numpy arrays), by the model's names
    counts: Mapping[MediaKind, int]


@dataclass(frozen=True)
class ToolFormat:
    """How one model writes a call: between `start` and `end`, read by `parse`."""

    start: str
    end: str
    parse: Callable[[str, Any], Any]  # mlx-lm's tool parser: (call text, tools) -> {name, arguments}

    @classmethod
    def of(cls, tokenizer: Any) -> ToolFormat | None:
        """The tokenizer's tool format, or None when its chat template has none mlx-lm reads."""
        if not getattr(tokenizer, "has_tool_calling", False):
            return None
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)


@dataclass(frozen=True)
class ToolUse:
    """What an engine request needs to report its calls."""

    format: ToolFormat
    tools: list[dict[str, Any]]  # as the request gave them, for the parser


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; `temperature` 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0  # these two count the generated tokens only, as in vLLM
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None


@dataclass(frozen=True)
class RequestRef:
    """Which delivery of which request: its id and the queue entry it came in. This, not
    the request's route, crosses to the engine and back: where its events go is the
    request table's to know (`requests.HeldRequest`)."""

    id: str
    entry_id: str


@dataclass(frozen=True)
class Route:
    """Where a request's events go and which queue entry they settle (held by the
    request table only)."""

    id: str
    entry_id: str
    reply_to: str
    encoding: Encoding
    stream: str  # the request stream (queue or lane) the entry is in
    fence: str = ""  # the token of this worker's taking of the request's fence ("": not taken yet)

    @property
    def ref(self) -> RequestRef:
        return RequestRef(self.id, self.entry_id)


@dataclass(frozen=True)
class Resume:
    """What earlier deliveries of a request already streamed; it continues right after."""

    tokens: list[int]  # every token id in the deltas written
    text: str  # the deltas' joined text
    deltas: int  # how many deltas were written: the next delta's seq
    reasoning: str = ""  # the deltas' joined reasoning


@dataclass(frozen=True)
class Thinking:
    """A thinking model's reasoning markers (one token each), and whether the prompt left
    a reasoning block open, so that the output starts inside it."""

    start: int
    end: int
    open: bool

    def place(self, token: int, inside: bool, answered: bool) -> tuple[Literal["reasoning", "text", "marker"], bool]:
        """Where one token of the output goes, given whether the output is inside the
        reasoning and has begun its answer: into the reasoning, the text, or neither (a
        marker); and whether the output is inside the reasoning after it. The markers count
        only until the answer starts (then they are text)."""
        if inside:
            return ("marker", False) if token == self.end else ("reasoning", True)
        if token == self.start and not answered:
            return "marker", True
        return "text", False

    def after(self, tokens: list[int]) -> tuple[bool, list[int]]:
        """Where an output made of `tokens` stands: still inside the reasoning, and the answer's tokens."""
        inside, answer = self.open, list[int]()
        for token in tokens:
            where, inside = self.place(token, inside, bool(answer))
            if where == "text":
                answer.append(token)
        return inside, answer


@dataclass(frozen=True)
class Queueing:
    """How a request waits, and what its answer carries back: the same for generation and pooling."""

    priority: int
    arrived_at: float  # unix seconds on this host's clock (the entry id's stamp): ages it, times it
    deadline_at: float | None = None  # unix seconds, or None
    metadata: dict[str, Any] | None = None
    alone: bool = False  # it was in an engine's death: it runs with no other request, so its next death is its own

    def expired(self, now: float) -> bool:
        """Whether its deadline passed before `now` (unix seconds)."""
        return self.deadline_at is not None and now > self.deadline_at


@dataclass(frozen=True)
class Stopping:
    """When a generation ends. `max_tokens` 0: it is only counted (`count_only`), never run."""

    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stop_tokens: frozenset[int] = frozenset()  # token ids that end it (eos unless ignore_eos, stop_token_ids)
    min_tokens: int = 0  # before this many tokens, stop tokens are masked and stop strings not looked for
    include_stop: bool = False  # the stop string that ended the text stays in it


@dataclass(frozen=True)
class Reporting:
    """What a generation's events carry besides its text, and how often deltas go out."""

    stream_interval: int = 1
    logprobs: int | None = None  # alternatives per token with each token's logprob; None: no logprobs
    tools: ToolUse | None = None  # when its output may call tools: they are parsed at the end
    thinking: Thinking | None = None  # on a thinking model: reasoning goes apart from the text


@dataclass(frozen=True)
class EngineRequest:
    """A validated, tokenized request, ready for the engine: its prompt and how it is
    sampled, when it stops, how it waits, what it reports."""

    ref: RequestRef
    prompt_tokens: list[int]
    sampling: SamplingParams
    stopping: Stopping
    queueing: Queueing
    reporting: Reporting = field(default_factory=Reporting)
    resume: Resume | None = None
    media: PreparedMedia | None = None  # what the media placeholder tokens in prompt_tokens stand for
    constraint: LLMatcher | None = None  # for its response_format (or forced call), advanced over `resume`'s tokens
    speculative: bool = True  # False: the request opted out of speculative decoding
    cache_salt: str = ""  # its prefix and vision caches' namespace: it hits only what its salt stored
    adapter: str = ""  # the LoRA adapter it runs with ("" : the model alone)
    prefix_chain: tuple[int, ...] = ()  # its prompt prefix as the fleet names it (`common.prefix_chain`)

    @property
    def id(self) -> str:
        return self.ref.id

    @property
    def prompt_size(self) -> int:
        return len(self.prompt_tokens)

    @property
    def tokens_to_generate(self) -> int:
        """What is left of `max_tokens` after the tokens already streamed."""
        return self.stopping.max_tokens - (len(self.resume.tokens) if self.resume else 0)

    @property
    def counted_only(self) -> bool:
        """Prepared only to count its prompt: answered without the engine."""
        return self.stopping.max_tokens == 0


@dataclass(frozen=True)
class PoolInput:
    """One sequence of a pooled pass: its tokens, and for a pair encoding each token's segment."""

    tokens: list[int]
    type_ids: list[int] | None = None


@dataclass(frozen=True)
class PoolingRequest:
    """A validated, tokenized embedding or rerank request: its sequences, each run once."""

    ref: RequestRef
    inputs: list[PoolInput]
    queueing: Queueing
    dimensions: int | None = None  # embeddings cut to this many, and normalized again
    base64: bool = False  # embeddings as base64 of little-endian float32, as OpenAI's encoding_format
    top_n: int | None = None  # a rerank's best documents to return (None: all)

    @property
    def id(self) -> str:
        return self.ref.id

    @property
    def prompt_size(self) -> int:
        return sum(len(item.tokens) for item in self.inputs)


@dataclass(frozen=True)
class Submit:
    """Command: queue a request in the engine."""

    request: EngineRequest | PoolingRequest


@dataclass(frozen=True)
class Cancel:
    """Command: stop a request, running or waiting; unknown ids are ignored."""

    request_id: str


@dataclass(frozen=True)
class Abandon:
    """Command: drop a request without a word, running or waiting: another worker took it."""

    request_id: str


@dataclass(frozen=True)
class Shutdown:
    """Command: drop waiting requests, finish running ones until `drain_until` (monotonic), stop."""

    drain_until: float


@dataclass(frozen=True)
class Ping:
    """Command (and I/O to engine): answer `Pong` between two steps (a hung engine never does)."""


@dataclass(frozen=True)
class SetAdapters:
    """Command (and I/O to engine): serve exactly these LoRA adapters, (name, path) each:
    load what is new or moved, unload what is gone (its running sequences finish)."""

    adapters: tuple[tuple[str, str], ...]


Command = Submit | Cancel | Abandon | Shutdown | Ping | SetAdapters


class EngineInbox(Protocol):
    """What the queue side may ask of the engine process, from the event loop."""

    async def prepare(self, message: Prepare, sent: Callable[[], None] = lambda: None) -> Preparation:
        """Prepare a request and queue it in the engine, unless it is answered at once;
        raises `EngineStopped` if the engine process ends first. `sent` is called once
        the message is on its way (the engine process takes requests in that order)."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def abandon(self, request_id: str) -> None: ...


class EngineStopped(RuntimeError):
    """The engine process ended while a request was prepared in it."""


@dataclass(frozen=True)
class Outgoing:
    """One event to publish, for the request delivery it belongs to."""

    ref: RequestRef
    event: Event


@dataclass
class StepOutput:
    """Everything one scheduler step produced, sent to the I/O process in one piece (`Step`)."""

    outgoing: list[Outgoing] = field(default_factory=list)
    abandoned: list[RequestRef] = field(default_factory=list)  # left un-acked at shutdown
    first_tokens: list[str] = field(default_factory=list)  # requests whose prefill ended in this step


def not_started(request: EngineRequest | PoolingRequest, now: float | None = None,
                reason: FinishReason = "cancelled") -> Outgoing:
    """The `done` of a request that ends before it was computed here: no new deltas or
    tokens (a resumed request's earlier deliveries' text and tokens are its own still)."""
    waited = round(((time.time() if now is None else now) - request.queueing.arrived_at) * 1000.0, 1)
    resume = request.resume if isinstance(request, EngineRequest) else None
    done = Done(id=request.id, finish_reason=reason, text=resume.text if resume else "",
                reasoning=(resume.reasoning or None) if resume else None,
                usage=Usage(request.prompt_size, len(resume.tokens) if resume else 0),
                timing=Timing(queued_ms=waited, ttft_ms=None, total_ms=waited), metadata=request.queueing.metadata)
    return Outgoing(request.ref, done)


def deadline_exceeded(request: EngineRequest | PoolingRequest) -> Outgoing:
    """The error of a request whose `deadline_ms` passed before it started."""
    return failed(request.ref, ErrorCode.DEADLINE_EXCEEDED, "the deadline passed before the request started")


def failed(ref: RequestRef, code: ErrorCode, message: str) -> Outgoing:
    """The `error` event of one request."""
    return Outgoing(ref, Error(id=ref.id, code=code, message=message))


@dataclass(frozen=True)
class CoreStats:
    """What a core counts of its requests: running and waiting; and for generation, the
    batch fills of constrained rows' masks and the time they took."""

    running: int
    waiting: int
    mask_fills: int = 0
    mask_fill_ms: float = 0.0


# ---- across the process boundary: the I/O process and its engine process ----------------
# Pickled, one frame per message (`worker.process.channel`); every type here is data alone.


@dataclass(frozen=True)
class Prepare:
    """I/O to engine: prepare a request (validate, template, tokenize, decode its media)
    and, unless it is answered without the engine, queue it. `answered` says what the
    I/O process knows already: it was cancelled before it was read."""

    envelope: Envelope
    ref: RequestRef
    arrived_at: float
    clock_offset_s: float
    resume: Resume | None = None
    priority_boost: int = 0  # added to its priority: a batch line waits behind interactive requests
    cancelled: bool = False
    alone: bool = False  # it was in an engine's death (`Queueing.alone`)


@dataclass(frozen=True)
class Admitted:
    """Engine to I/O: the request is prepared (at `prepared_at`, unix seconds) and queued in the engine."""

    ref: RequestRef
    prepared_at: float


@dataclass(frozen=True)
class Answered:
    """Engine to I/O: the request is prepared and ends without the engine (cancelled
    before it started, or only counted); `outgoing` is its terminal event."""

    ref: RequestRef
    outgoing: Outgoing
    prepared_at: float


@dataclass(frozen=True)
class Refused:
    """Engine to I/O: the request cannot be served (`code`, and a message that says why)."""

    ref: RequestRef
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class DecoderCrashed:
    """Engine to I/O: the media decoder's process died on this request (it counts as a crash)."""

    ref: RequestRef
    reason: str


Preparation = Admitted | Answered | Refused | DecoderCrashed


@dataclass(frozen=True)
class EngineReady:
    """Engine to I/O, once: the model is loaded; what the I/O process needs to know of it."""

    name: str
    task: Task
    tool_call: tuple[str, str] | None  # the model's tool-call markers, for the heartbeat


@dataclass(frozen=True)
class LoadFailed:
    """Engine to I/O, instead of `EngineReady`: the model could not be loaded."""

    reason: str


@dataclass(frozen=True)
class Started:
    """Engine to I/O, sent before the step that starts them: these requests enter the
    batch. What the engine computes when it dies is what its death is blamed on."""

    request_ids: list[str]


@dataclass(frozen=True)
class Step:
    """Engine to I/O: one scheduler step's events (and, at the drain deadline, what is
    left), and the requests whose prefill it ended."""

    outgoing: list[Outgoing]
    abandoned: list[RequestRef] = field(default_factory=list)
    first_tokens: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Pong:
    """Engine to I/O: the answer to `Ping`, from between two steps."""


@dataclass(frozen=True)
class Stopped:
    """Engine to I/O, last: the drain is over; the process exits."""
