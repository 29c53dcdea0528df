"""Engine backends: the batch generators the engine drives, and loading a model for one.

The engine sees only `BatchBackend` and `Loaded`; each backend module owns one library's
batching API, which moves between minor releases:

    mlx_lm    text models, mlx-lm's BatchGenerator
    mlx_vlm   vision-language models, mlx-vlm's BatchGenerator (the `vision` extra)
    sim       a simulated engine for fleet-scale runs (`--model sim:...`)

`load_model` picks mlx-vlm when the model's config has a vision tower or a setting asks
for what only mlx-vlm's batch has (a quantized KV cache, an SSD tier), else mlx-lm. It runs on the
engine thread; this module imports no MLX itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..messages import CacheStats, PoolInput

if TYPE_CHECKING:
    from mlx_lm.sample_utils import LogitsProcessor, Sampler

    from ..media import PreparedMedia
    from ..prefix_cache import PrefixCache
    from ..scheduler import StepPlan
    from ..settings import WorkerSettings
    from ..vision_prompts import VisionPrompts

VISION_EXTRA = "pip install '.[worker,vision]' in the mlxq checkout"


@dataclass(frozen=True)
class Coverage:
    """A sequence's KV cache and exactly the tokens it covers (prompt and generated)."""

    cache: list[Any]
    tokens: list[int]


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
               cache_salt: str = "") -> int:
        """Start a sequence; with `cached`, `prompt` is what follows the tokens it covers;
        `media` (on a vision model) is what the placeholder tokens in `prompt` stand for;
        with `logprobs`, its tokens come with the row they were drawn from (`TokenOut`);
        without `speculative`, it takes no part in speculative decoding; `cache_salt` is the
        namespace of the caches it may hit and fill (a backend with caches of its own). A
        step may give a sequence several tokens (speculative decoding), in order."""
        ...

    def remove(self, uids: Iterable[int], keep_caches: bool = False) -> dict[int, Coverage]:
        """Stop sequences; with `keep_caches`, return their caches."""
        ...

    def step(self, plan: StepPlan) -> list[TokenOut]:
        """Decode one token of every running sequence and prefill what `plan` allows."""
        ...

    def upcoming_tokens(self) -> dict[int, int]:
        """Each sequence's next input token, which the next `step` appends to what its
        logits processors see (for filling their masks together); {} where unknown."""
        ...

    def close(self) -> None: ...


Task = Literal["generate", "embed", "rerank"]
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


def load_model(settings: WorkerSettings) -> Loaded:
    """The configured model (a local path or a Hugging Face id), loaded by mlx-vlm if its
    config has a vision tower, else by mlx-lm."""
    assert settings.model is not None, "the command line resolves the demo model"
    if settings.model.startswith("sim:") or settings.unavailable is not None:
        from .sim import load_sim

        return load_sim(settings.model if settings.unavailable is None else "sim:", name=settings.model)
    task = task_of(settings)
    if task != "generate":
        try:
            from .pooling import load_pooling_model
        except ImportError as e:
            raise RuntimeError(f"{settings.model} serves {task}: {VISION_EXTRA} ({e})") from e
        return load_pooling_model(settings, task)
    vision = is_vision_model(settings.model)
    needs = mlx_vlm_only(settings)
    if vision or needs:
        try:
            from .mlx_vlm import load_through_mlx_vlm
        except ImportError as e:
            why = "is a vision model" if vision else f"with {needs}"
            raise RuntimeError(f"{settings.model} {why}: {VISION_EXTRA} ({e})") from e
        return load_through_mlx_vlm(settings, vision=vision)
    from .mlx_lm import load_text_model

    return load_text_model(settings)


def mlx_vlm_only(settings: WorkerSettings) -> str | None:
    """The settings that only mlx-vlm's batch serves (mlx-lm 0.32's has no quantized
    KV cache, and its prefix cache no disk tier), named for a message; None when
    mlx-lm's batch serves them all."""
    named = [name for name in ("kv_bits", "ssd_cache_dir") if getattr(settings, name) is not None]
    return " and ".join(named) or None


def task_of(settings: WorkerSettings) -> Task:
    """The configured task, or the one the model's files say (`WorkerSettings.task`)."""
    if settings.task != "auto":
        return settings.task
    assert settings.model is not None
    config = json.loads(model_file(settings.model, "config.json").read_text())
    if any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return "rerank"
    return "embed" if has_model_file(settings.model, "modules.json") else "generate"


def is_vision_model(path: str) -> bool:
    """Whether the model's config describes a vision-language model (it has a vision tower)."""
    return "vision_config" in json.loads(model_file(path, "config.json").read_text())


def has_model_file(path: str, name: str) -> bool:
    """Whether a model directory or Hugging Face repository has this file."""
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return model_file(path, name).exists()
    except EntryNotFoundError:
        return False


def model_file(path: str, name: str) -> Path:
    """One file of a model directory, or of a Hugging Face repository (fetched alone)."""
    local = Path(path)
    if local.is_dir():
        return local / name
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(path, name))
    except EntryNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, bad id, no access: one message for all
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise RuntimeError(f"model {path!r} is not a local directory, and Hugging Face did not provide it "
                           f"({type(e).__name__}: {reason}); give a model directory or a Hugging Face id "
                           "such as mlx-community/Qwen3-0.6B-8bit") from e
