"""The types every backend shares: what the engine drives (`BatchBackend`), what a loader
returns (`Loaded`), what the event loop may know of the model (`ModelInfo`), and one
step's token (`TokenOut`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from client.engine_stats import CacheStats
from client.protocol import Task
from worker.engine.coverage import Coverage
from worker.messages import PoolInput

if TYPE_CHECKING:
    from mlx_lm.sample_utils import LogitsProcessor, Sampler

    from worker.engine.adapters import AdapterBank
    from worker.engine.prefix_cache import PrefixCache
    from worker.engine.scheduler import StepPlan
    from worker.media.vision_prompts import VisionPrompts
    from worker.messages import PreparedMedia

VISION_EXTRA = "pip install '.[worker,vision]' in the mlxq checkout"


@dataclass(frozen=True)
class TokenOut:
    """One sequence's token from one decode step; `finish_reason` is set on its last,
    which also carries the sequence's cache when the backend gives it."""

    uid: int
    token: int
    finish_reason: str | None  # "stop" (an eos id) | "length" | None
    coverage: Coverage | None = None
    cached_tokens: int | None = None  # on a sequence's first token, from a backend that finds cached prefixes itself
    logprobs: Any = None  # the log-softmax row the token was sampled from (an mx.array), where the backend gives it


class BatchBackend(Protocol):
    """What the engine needs from a continuous-batching generator."""

    def insert(self, prompt: list[int], max_tokens: int, sampler: Sampler,
               logits_processors: list[LogitsProcessor], cached: Coverage | None = None,
               media: PreparedMedia | None = None, logprobs: bool = False, speculative: bool = True,
               cache_salt: str = "", adapter: int = 0) -> int:
        """Start a sequence; with `cached`, `prompt` is what follows the tokens it covers;
        `media` (on a vision model) is what the placeholder tokens in `prompt` stand for;
        with `logprobs`, its tokens come with the row they were drawn from (`TokenOut`);
        without `speculative`, it takes no part in speculative decoding; `cache_salt` is the
        namespace of the caches it may hit and fill (a backend with caches of its own);
        `adapter` is the slot of its LoRA adapter (`Loaded.adapters`; 0: none). A step may
        give a sequence several tokens (speculative decoding), in order."""
        ...

    def remove(self, uids: Iterable[int], keep_caches: bool = False) -> dict[int, Coverage]:
        """Stop sequences; with `keep_caches`, return their caches."""
        ...

    def step(self, plan: StepPlan) -> list[TokenOut]:
        """Decode one token of every running sequence and prefill what `plan` allows."""
        ...

    def running_cache(self, uid: int) -> Coverage | None:
        """The cache of a sequence past its prefill, as it stands (its prompt and what it
        made so far), for the prefix cache to copy; None where the backend cannot give it."""
        ...

    def upcoming_tokens(self) -> dict[int, int]:
        """Each sequence's next input token, which the next `step` appends to what its
        logits processors see (for filling their masks together); {} where unknown."""
        ...

    def close(self) -> None: ...


RerankFormat = Literal["classifier", "qwen3"]


@dataclass(frozen=True)
class PoolingInfo:
    """What the event loop needs to know of an embedding model or a reranker to prepare its requests."""

    task: Task
    max_length: int  # tokens of one input (of a query and a document together, for a reranker), at most
    pad_id: int
    dimensions: int = 0  # an embedding's length
    matryoshka: bool | tuple[int, ...] = False  # sizes an embedding may be cut to: any (True), these, or none
    rerank_format: RerankFormat | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the event loop may know of the loaded model (the tokenizer only encodes there)."""

    name: str
    tokenizer: Any
    context_length: int
    vocab_size: int
    vision: VisionPrompts | None = None  # on a vision model, what builds image prompts
    logprobs: bool = True  # whether its backend gives each token's log-probability row
    pooling: PoolingInfo | None = None  # an embedding model's or a reranker's: it serves no generation

    @property
    def task(self) -> Task:
        return "generate" if self.pooling is None else self.pooling.task


@dataclass
class Loaded:
    """What a loader returns; made and used on the engine thread only."""

    info: ModelInfo
    make_backend: Callable[[], BatchBackend]
    new_detokenizer: Callable[[], Any]
    prefix_cache: PrefixCache | None = None  # the engine's own; a backend may keep caches of its own
    cache_stats: Callable[[], dict[str, CacheStats | None]] = dict  # the backend's own caches, by heartbeat name
    memory: Callable[[], dict[str, int]] = dict  # the framework's memory figures, in bytes
    release_memory: Callable[[], None] = lambda: None  # return cached buffers to the system
    speculation: Callable[[], dict[str, Any]] | None = None  # speculative decoding's counters, where it runs
    pooler: Callable[[Sequence[PoolInput]], Any] | None = None  # a pooling model's pass: (B, D) vectors or (B,) scores
    adapters: AdapterBank | None = None  # a text model's LoRA adapters, where it serves them
