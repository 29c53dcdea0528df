"""Vision models through mlx-vlm: loading, and its BatchGenerator behind `BatchBackend`.

Text-only and image requests share one mlx-vlm BatchGenerator, so they batch together.
Each request enters with its prompt embeddings, made here on the engine thread: the
vision tower runs once per image not in the vision-embedding cache, and the model
merges the image features into the token embeddings (with Qwen2-VL's multimodal
rotary positions). Like `mlx_lm`, only this module touches its library's batching API.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import LogitsProcessor, Sampler, greedy_sampler

from ..images import SUPPORTED_MODEL_TYPES, VisionPrompts
from ..media import PreparedMedia
from ..messages import CacheStats
from ..scheduler import MIN_PREFILL_CHUNK, StepPlan
from ..settings import WorkerSettings
from ..vision_cache import VisionCache
from . import Coverage, Loaded, ModelInfo, TokenOut
from .mlx_lm import mlx_memory, upcoming_tokens


def load_vision_model(settings: WorkerSettings) -> Loaded:
    """Load a Qwen2-VL-family model and its processor through mlx-vlm's `load()`."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm import load
    from mlx_vlm.utils import get_model_path
    from transformers.utils import logging as transformers_logging

    # mlx-vlm's chat formatting passes options a template may not use, and transformers
    # warns about that on every request; our own log says what happened to each request.
    transformers_logging.set_verbosity_error()
    assert settings.model is not None
    name = path = settings.model
    local = get_model_path(path)
    model, processor = load(str(local))
    model_type = model.config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{name}: mlxq serves the vision models {', '.join(SUPPORTED_MODEL_TYPES)}; "
                         f"this one is {model_type}")
    # The text side exactly as on a text model: mlx-lm's tokenizer wrapper (chat template,
    # streaming detokenizer) with the eos ids mlx-vlm stops on.
    tokenizer = load_tokenizer(local, eos_token_ids=sorted(processor.tokenizer.stopping_criteria.eos_token_ids))
    # Nor eos stops its batch, as on mlx-lm's: each request's stop tokens (eos unless it
    # says ignore_eos, its stop_token_ids, min_tokens holding them back) are the engine's.
    processor.tokenizer.stopping_criteria = _NoStops()
    text_config = model.config.text_config
    prompts = VisionPrompts(processor, model.config, name, max_images=settings.max_images,
                            max_image_pixels=settings.max_image_pixels)
    info = ModelInfo(name=name, tokenizer=tokenizer, context_length=int(text_config.max_position_embeddings or 4096),
                     vocab_size=int(text_config.vocab_size), vision=prompts)
    vision_cache = VisionCache(settings.vision_cache_mb * 1024 * 1024)
    prefix_cache = _prefix_cache(model, settings.cache_budget_bytes())

    def make_backend() -> VisionBatchBackend:
        return VisionBatchBackend(model, processor, vision_cache, prefix_cache, max_num_seqs=settings.max_num_seqs,
                                  prefill_batch_size=settings.prefill_batch_size,
                                  prefill_step_size=settings.prefill_step_size)

    def cache_stats() -> dict[str, CacheStats | None]:
        return {"prefix_cache": None if prefix_cache is None else _prefix_stats(prefix_cache),
                "vision_cache": vision_cache.stats()}

    return Loaded(info=info, make_backend=make_backend, new_detokenizer=lambda: tokenizer.detokenizer,
                  cache_stats=cache_stats, memory=mlx_memory, release_memory=mx.clear_cache)


def _prefix_cache(model: Any, budget_bytes: int) -> Any:
    """mlx-vlm's automatic prefix cache (blocks of 16 tokens, hashed with the images they
    hold), sized to the prefix-cache budget; None when the budget is 0. Our own PrefixCache
    cannot be used here: mlx-vlm's generator takes no per-request KV cache at insert."""
    from mlx_vlm.apc import DEFAULT_BLOCK_SIZE, APCManager

    config = model.config.text_config
    heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = model.language_model.model.embed_tokens.weight.dtype.size
    block_bytes = 2 * config.num_hidden_layers * heads * head_dim * itemsize * DEFAULT_BLOCK_SIZE  # K and V
    blocks = min(budget_bytes // block_bytes, MAX_PREFIX_BLOCKS)
    return APCManager(num_blocks=blocks, block_size=DEFAULT_BLOCK_SIZE) if blocks > 0 else None


# 32k tokens. mlx-vlm scans its whole block pool (Python objects) several times per
# admitted prompt, so TTFT grows with the pool (docs/benchmarks.md, "Images").
MAX_PREFIX_BLOCKS = 2048


def _prefix_stats(cache: Any) -> CacheStats:
    """mlx-vlm's block cache in the common shape: its entries are blocks of 16 tokens."""
    stats = cache.stats
    return CacheStats(entries=stats.pool_used, hits=stats.hits, misses=stats.misses, capacity=cache.num_blocks)


class VisionBatchBackend:
    """`BatchBackend` over mlx-vlm 0.7's BatchGenerator."""

    def __init__(self, model: Any, processor: Any, cache: VisionCache, prefix_cache: Any, *, max_num_seqs: int,
                 prefill_batch_size: int, prefill_step_size: int) -> None:
        from mlx_vlm.generate.ar import BatchGenerator

        self._model = model
        self._cache = cache
        self._cached_tokens: dict[int, int] = {}  # prefilled, first token not yet out
        self._taps: dict[int, _LogprobsTap] = {}  # the sequences that asked for logprobs
        prefill_batch_size = self._prefill_batch_size = min(prefill_batch_size, max_num_seqs)
        # mlx-vlm prefills only when `completion_batch_size - running >= prefill_batch_size`
        # (and never when completion < prefill). The engine admits at most max_num_seqs,
        # so this size never holds back a request the engine has admitted.
        self._generator = BatchGenerator(model.language_model, processor, compute_logprobs=False,
                                         completion_batch_size=max_num_seqs + prefill_batch_size,
                                         prefill_batch_size=prefill_batch_size,
                                         prefill_step_size=prefill_step_size, apc_manager=prefix_cache)

    def insert(self, prompt: list[int], max_tokens: int, sampler: Sampler,
               logits_processors: list[LogitsProcessor], cached: Coverage | None = None,
               media: Sequence[PreparedMedia] = (), logprobs: bool = False) -> int:
        processors = list(logits_processors)
        tap = _LogprobsTap() if logprobs else None
        if tap is not None:  # after every processor (what the token is drawn from), before the draw
            processors.append(tap)
        if sampler is not greedy_sampler:
            processors.append(_OwnSampler(sampler))
        (uid,) = self._generator.insert([prompt], [max_tokens], prompt_kwargs=[self._embed(prompt, media)],
                                        logits_processors=[processors or None])
        if tap is not None:
            self._taps[uid] = tap
        return uid

    def remove(self, uids: Iterable[int], keep_caches: bool = False) -> dict[int, Coverage]:
        for uid in uids:
            self._generator.remove(uid)
            self._cached_tokens.pop(uid, None)
            self._taps.pop(uid, None)
        return {}

    def step(self, plan: StepPlan) -> list[TokenOut]:
        self._follow(plan)
        prefilled, generated = self._generator.next()
        self._cached_tokens.update((p.uid, p.cached_tokens) for p in prefilled)
        return [TokenOut(r.uid, r.token, r.finish_reason, cached_tokens=self._cached_tokens.pop(r.uid, None),
                         logprobs=self._drawn_from(r.uid))
                for r in generated]

    def _follow(self, plan: StepPlan) -> None:
        """Keep the step within the scheduler's plan (`scheduler.StepBudget`). mlx-vlm's
        step decodes every running sequence, then prefills one chunk of its prompt batch
        (all its rows at once), or forms the next batch from up to `prefill_batch_size`
        waiting prompts. The sizes of the next batch are the plan's; the batch in flight
        reads its chunk size at every chunk, so its rows share the plan's prompt tokens."""
        generator = self._generator
        generator.prefill_step_size = plan.prefill_chunk
        generator.prefill_batch_size = min(plan.prefill_prompts, self._prefill_batch_size)
        # Its private state, read as upcoming_tokens reads it: a release that moves it leaves
        # the batch in flight at its own chunk, never a step that fails.
        batch: Any = getattr(generator, "_prompt_batch", None)
        if getattr(batch, "prefill_step_size", None) is not None:  # None: prefilled whole (no chunks)
            rows = max(1, len(getattr(batch, "uids", ())))  # more rows than the plan's prompts share their tokens
            share = plan.prefill_chunk * min(plan.prefill_prompts, rows) // rows
            batch.prefill_step_size = max(MIN_PREFILL_CHUNK, share)

    def _drawn_from(self, uid: int) -> mx.array | None:
        tap = self._taps.get(uid)
        return tap.rows.popleft() if tap is not None and tap.rows else None

    def upcoming_tokens(self) -> dict[int, int]:
        return upcoming_tokens(self._generator)

    def close(self) -> None:
        self._generator.close()

    def _embed(self, prompt: list[int], images: Sequence[PreparedMedia]) -> dict[str, mx.array]:
        """The prompt's embeddings (image features merged in) and rotary positions."""
        ids = mx.array([prompt])
        if not images:
            out = self._model.get_input_embeddings(ids)
            extra = {}
        else:
            grid = mx.array(np.concatenate([image.payload["image_grid_thw"] for image in images]))
            features = mx.concatenate([self._features(image) for image in images])
            pixels = mx.array(np.concatenate([image.payload["pixel_values"] for image in images]))
            out = self._model.get_input_embeddings(ids, pixels, image_grid_thw=grid, cached_image_features=features)
            extra = {"image_grid_thw": grid}
        return {**extra, **{k: v for k, v in out.to_dict().items() if v is not None}}

    def _features(self, image: PreparedMedia) -> mx.array:
        """The vision tower's output for one image, from the cache when it was seen before."""
        features = self._cache.get(image.key)
        if features is None:
            features = self._model.vision_tower(mx.array(image.payload["pixel_values"]),
                                                mx.array(image.payload["image_grid_thw"]), output_hidden_states=False)
            self._cache.put(image.key, features)
        return features


class _NoStops:
    """mlx-vlm's stopping criteria (eos ids it ends a sequence on), with none."""

    eos_token_ids: list[int] = []

    def add_eos_token_ids(self, new_eos_token_ids: Any = None) -> None:
        """The generator adds its `stop_tokens` here (we give none)."""

    def reset(self, eos_token_ids: Any = None) -> None: ...

    def __call__(self, token: Any) -> bool:
        return False


class _LogprobsTap:
    """The log-softmax rows a sequence's tokens are drawn from, kept in order: mlx-vlm's
    batch gives only the chosen token's logprob, and only batch-wide, so a sequence that
    asked for logprobs keeps its rows itself, as a logits processor that changes nothing.
    Its batch samples a token a step before handing it out (prefill's first token too),
    so the row of the token handed out now is the oldest kept."""

    def __init__(self) -> None:
        self.rows: collections.deque[mx.array] = collections.deque()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.rows.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        return logits


class _OwnSampler:
    """A request's own sampler as a logits processor. mlx-vlm's generator has one sampler
    for the whole batch (argmax here), so a sampled request draws its token itself and
    leaves only that token possible: its draws never depend on its neighbours."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = self.sampler(logprobs)
        return mx.where(mx.arange(logits.shape[-1]) == token[:, None], 0.0, -mx.inf)
