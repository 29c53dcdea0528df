"""Vision models through mlx-vlm: loading, and its BatchGenerator behind `BatchBackend`.

Text-only and media requests share one mlx-vlm BatchGenerator, so they batch together.
Each request enters with its prompt embeddings, made here on the engine thread by the
model's own `get_input_embeddings` from what its processor prepared (with whatever
else the family's language model takes: Qwen's multimodal rotary positions, ...); the
vision tower is skipped for media in the vision-embedding cache, in the families whose
features can be cached (`vision_features`). Like `mlx_lm`, only this module touches
its library's batching API.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import structlog
from mlx_lm.sample_utils import LogitsProcessor, Sampler, greedy_sampler
from mlx_vlm.models.cache import should_quantize_kv_layer

from client.engine_stats import CacheStats
from worker.engine.backends.base import Coverage, Loaded, ModelInfo, TokenOut
from worker.engine.backends.kv_start import QuantizeFrom
from worker.engine.backends.mlx_lm import mlx_memory, upcoming_tokens
from worker.engine.backends.packed_prefix import PackedPrefixCoordinator, packed_bytes_per_token
from worker.engine.backends.vision_features import Encoder, encoder_for, not_cached_because
from worker.engine.scheduler import MIN_PREFILL_CHUNK, StepPlan
from worker.media.vision_cache import VisionCache
from worker.media.vision_prompts import VisionPrompts
from worker.messages import PreparedMedia
from worker.settings import WorkerSettings

log = structlog.get_logger()


def load_vision_model(settings: WorkerSettings) -> Loaded:
    """Load a vision model of any family mlx-vlm batches, and its processor, through mlx-vlm's `load()`."""
    return load_through_mlx_vlm(settings, vision=True)


def load_through_mlx_vlm(settings: WorkerSettings, *, vision: bool) -> Loaded:
    """A model in mlx-vlm's batch: a vision model, or a text model for what only that
    batch has (a quantized KV cache, the prefix cache's SSD tier); mlx-vlm loads text
    models too."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm import load
    from mlx_vlm.utils import get_model_path
    from transformers.utils import logging as transformers_logging

    # mlx-vlm's chat formatting passes options a template may not use, and transformers
    # warns about that on every request; our own log says what happened to each request.
    transformers_logging.set_verbosity_error()
    assert settings.model is not None
    name = path = settings.model
    where = "a vision model" if vision else "a text model with kv_bits or ssd_cache_dir"
    if settings.max_kv_size is not None:
        raise ValueError(f"{name}: max_kv_size is served through mlx-lm's batch only (mlx-vlm 0.7.10's takes none), "
                         f"so not on {where}")
    for setting in ("prompt_lookup_max", "draft_model"):
        if getattr(settings, setting):
            raise ValueError(f"{name}: {setting} is served through mlx-lm's batch only, so not on {where}")
    local = get_model_path(path)
    model, processor = load(str(local))
    refusal = unbatchable(model)
    if refusal is not None:
        raise ValueError(f"{name}: mlxq cannot serve this {model.config.model_type} model: {refusal}")
    text_config = _text_config(model)
    kv_quantization = kv_quantization_of(settings, text_config)
    encoder = encoder_for(model) if vision else None
    if vision and encoder is None:
        log.info("vision features not cached", model_type=model.config.model_type,
                 reason=not_cached_because(model.config.model_type))
    stopping = _tokenizer_of(processor).stopping_criteria
    # The text side exactly as on a text model: mlx-lm's tokenizer wrapper (chat template,
    # streaming detokenizer) with the eos ids mlx-vlm stops on.
    tokenizer = load_tokenizer(local, eos_token_ids=sorted(stopping.eos_token_ids))
    # Nor eos stops its batch, as on mlx-lm's: each request's stop tokens (eos unless it
    # says ignore_eos, its stop_token_ids, min_tokens holding them back) are the engine's.
    _tokenizer_of(processor).stopping_criteria = _NoStops()
    prompts = VisionPrompts(processor, model.config, name, settings) if vision else None
    info = ModelInfo(name=name, tokenizer=tokenizer, context_length=int(text_config.max_position_embeddings or 4096),
                     vocab_size=int(text_config.vocab_size), vision=prompts)
    vision_cache = VisionCache(settings.vision_cache_mb * 1024 * 1024 if vision else 0)
    prefix_cache = _prefix_cache(model, settings.cache_budget_bytes(), kv_quantization,
                                 _disk_store(settings, local, kv_quantization))

    def make_backend() -> VisionBatchBackend:
        return VisionBatchBackend(model, processor, encoder, vision_cache, prefix_cache,
                                  max_num_seqs=settings.max_num_seqs,
                                  prefill_batch_size=settings.prefill_batch_size,
                                  prefill_step_size=settings.prefill_step_size, kv_quantization=kv_quantization)

    def cache_stats() -> dict[str, CacheStats | None]:
        return {"prefix_cache": None if prefix_cache is None else _prefix_stats(prefix_cache),
                "vision_cache": vision_cache.stats() if vision else None,
                "ssd_cache": None if prefix_cache is None or prefix_cache.disk is None else _disk_stats(prefix_cache)}

    return Loaded(info=info, make_backend=make_backend, new_detokenizer=lambda: tokenizer.detokenizer,
                  cache_stats=cache_stats, memory=mlx_memory, release_memory=mx.clear_cache)


def packs_prefix_entries(kv_quantization: dict[str, Any]) -> bool:
    """Whether the prefix cache keeps quantized codes (`packed_prefix`): when the batch
    quantizes from the first token, so its blocks are the batch's codes. From a start, the
    blocks are the dense prefill's, which the switch quantizes as a cold run's."""
    return bool(kv_quantization) and not kv_quantization.get("quantized_kv_start")


def kv_quantization_of(settings: WorkerSettings, text_config: Any) -> dict[str, Any]:
    """The configured KV quantization ({} for none): bits, group_size, quantized_kv_start,
    checked against the model: `mx.quantize` groups each key's and value's last axis, the head."""
    if settings.kv_bits is None:
        return {}
    head_dim = _head_dim(text_config)
    if head_dim % settings.kv_group_size:
        raise ValueError(f"{settings.model}: kv_group_size {settings.kv_group_size} does not divide the model's "
                         f"head dimension {head_dim}; mx.quantize groups along it (sizes 32, 64, 128)")
    return {"bits": settings.kv_bits, "group_size": settings.kv_group_size,
            "quantized_kv_start": settings.quantized_kv_start}


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _tokenizer_of(processor: Any) -> Any:
    """The tokenizer mlx-vlm's batch reads its stopping criteria from: a vision model's
    processor holds one, a text model's processor is one."""
    return processor.tokenizer if hasattr(processor, "tokenizer") else processor


def unbatchable(model: Any) -> str | None:
    """Why mlx-vlm's BatchGenerator cannot serve `model`, or None when it can: its batch
    takes each prompt as embeddings from the model's language model."""
    from mlx_vlm.generate.diffusion import is_diffusion_model

    if not hasattr(model, "language_model") or not hasattr(model, "get_input_embeddings"):
        return "it has no language model taking input embeddings, which mlx-vlm's batch needs"
    if is_diffusion_model(model):
        return "it generates by diffusion, which mlx-vlm's autoregressive batch does not run"
    return None


def _text_config(model: Any) -> Any:
    return getattr(model.config, "text_config", None) or model.config


def _disk_store(settings: WorkerSettings, local: Any, kv_quantization: dict[str, Any]) -> Any:
    """The prefix cache's SSD tier (`ssd_tier`), or None when not configured."""
    if settings.ssd_cache_dir is None:
        return None
    if settings.cache_budget_bytes() <= 0:
        raise ValueError("ssd_cache_dir is the tier below the prefix cache in memory, which is off "
                         "(cache_memory_mb 0): give it a budget, or unset ssd_cache_dir")
    from worker.engine.backends.ssd_tier import open_store

    return open_store(settings.ssd_cache_dir.expanduser(), Path(local), int(settings.ssd_cache_max_gb * 2**30),
                      kv_quantization, packed=packs_prefix_entries(kv_quantization))


def _prefix_cache(model: Any, budget_bytes: int, kv_quantization: dict[str, Any], disk: Any = None) -> Any:
    """mlx-vlm's automatic prefix cache (blocks of 16 tokens, hashed with the images they
    hold), as many blocks as the prefix-cache budget holds (more when they are packed
    codes), over `disk` (its SSD tier) when given; None when the budget is 0. Our own
    PrefixCache cannot be used here: mlx-vlm's generator takes no per-request KV cache at insert."""
    from mlx_vlm.apc import DEFAULT_BLOCK_SIZE, APCManager

    config = _text_config(model)
    heads = config.num_key_value_heads or config.num_attention_heads
    head_dim, layers, itemsize = _head_dim(config), config.num_hidden_layers, _dtype(model).size
    packed = [packs_prefix_entries(kv_quantization) and should_quantize_kv_layer(i, layers) for i in range(layers)]
    token_bytes = sum(packed_bytes_per_token(head_dim, kv_quantization["bits"], kv_quantization["group_size"],
                                             itemsize) if quantized else head_dim * itemsize for quantized in packed)
    block_bytes = 2 * heads * token_bytes * DEFAULT_BLOCK_SIZE  # K and V
    blocks = min(budget_bytes // block_bytes, MAX_PREFIX_BLOCKS)
    return APCManager(num_blocks=blocks, block_size=DEFAULT_BLOCK_SIZE, disk=disk) if blocks > 0 else None


# 32k tokens. mlx-vlm scans its whole block pool (Python objects) several times per
# admitted prompt, so TTFT grows with the pool (docs/benchmarks.md, "Images").
MAX_PREFIX_BLOCKS = 2048


def _disk_stats(cache: Any) -> CacheStats:
    """The SSD tier in the common shape: entries are the blocks it indexes, hits the lookups
    it answered, misses those neither tier could, refused the writes that failed."""
    stats, disk = cache.stats, cache.disk
    return CacheStats(entries=disk.num_blocks_indexed, hits=stats.disk_hits, misses=stats.misses,
                      bytes=disk.disk_bytes, refused=stats.disk_write_failures)


def _prefix_stats(cache: Any) -> CacheStats:
    """mlx-vlm's block cache in the common shape: its entries are blocks of 16 tokens."""
    stats = cache.stats
    return CacheStats(entries=stats.pool_used, hits=stats.hits, misses=stats.misses, capacity=cache.num_blocks)


class VisionBatchBackend:
    """`BatchBackend` over mlx-vlm 0.7's BatchGenerator."""

    def __init__(self, model: Any, processor: Any, encoder: Encoder | None, cache: VisionCache, prefix_cache: Any, *,
                 max_num_seqs: int, prefill_batch_size: int, prefill_step_size: int,
                 kv_quantization: dict[str, Any] | None = None) -> None:
        from mlx_vlm.generate.ar import BatchGenerator

        self._model = model
        self._encoder = encoder
        self._disk = getattr(prefix_cache, "disk", None)
        self._media_prefills_alone = model.config.model_type in MEDIA_PREFILLS_ALONE
        self._media_uids: set[int] = set()  # waiting or prefilling, in such a family
        self._cache = cache
        self._cached_tokens: dict[int, int] = {}  # prefilled, first token not yet out
        self._taps: dict[int, _LogprobsTap] = {}  # the sequences that asked for logprobs
        prefill_batch_size = self._prefill_batch_size = min(prefill_batch_size, max_num_seqs)
        # mlx-vlm prefills only when `completion_batch_size - running >= prefill_batch_size`
        # (and never when completion < prefill). The engine admits at most max_num_seqs,
        # so this size never holds back a request the engine has admitted.
        quantization = dict(kv_quantization or {})
        start = quantization.pop("quantized_kv_start", 0)
        # From the first position mlx-vlm's batch quantizes; from a later one it runs dense
        # and is switched between steps.
        self._quantize_from = QuantizeFrom(start, **quantization) if start else None
        native = {} if start or not quantization else {"kv_bits": quantization["bits"],
                                                       "kv_group_size": quantization["group_size"]}
        self._generator = BatchGenerator(model.language_model, processor, compute_logprobs=False,
                                         completion_batch_size=max_num_seqs + prefill_batch_size,
                                         prefill_batch_size=prefill_batch_size,
                                         prefill_step_size=prefill_step_size, apc_manager=prefix_cache,
                                         **native)
        if native and self._generator.apc is not None:  # its prefix cache keeps the batch's codes
            self._generator.apc = PackedPrefixCoordinator(prefix_cache, model.language_model, bits=quantization["bits"],
                                                          group_size=quantization["group_size"], dtype=_dtype(model))

    def insert(self, prompt: list[int], max_tokens: int, sampler: Sampler,
               logits_processors: list[LogitsProcessor], cached: Coverage | None = None,
               media: PreparedMedia | None = None, logprobs: bool = False, speculative: bool = True,
               cache_salt: str = "", adapter: int = 0) -> int:
        assert adapter == 0, "adapters are served on mlx-lm's batch only"
        processors = list(logits_processors)
        tap = _LogprobsTap() if logprobs else None
        if tap is not None:  # after every processor (what the token is drawn from), before the draw
            processors.append(tap)
        if sampler is not greedy_sampler:
            processors.append(_OwnSampler(sampler))
        (uid,) = self._generator.insert([prompt], [max_tokens], prompt_kwargs=[self._embed(prompt, media, cache_salt)],
                                        logits_processors=[processors or None])
        if tap is not None:
            self._taps[uid] = tap
        if media is not None and self._media_prefills_alone:
            self._media_uids.add(uid)
        return uid

    def remove(self, uids: Iterable[int], keep_caches: bool = False) -> dict[int, Coverage]:
        for uid in uids:
            self._generator.remove(uid)
            self._cached_tokens.pop(uid, None)
            self._taps.pop(uid, None)
            self._media_uids.discard(uid)
        return {}

    def step(self, plan: StepPlan) -> list[TokenOut]:
        self._follow(plan)
        prefilled, generated = self._generator.next()
        if self._quantize_from is not None:
            self._quantize_from.after_step(self._generator._generation_batch)
        self._cached_tokens.update((p.uid, p.cached_tokens) for p in prefilled)
        self._media_uids.difference_update(p.uid for p in prefilled)
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
        if self._media_uids:  # one of those among the next prompts: each of them prefills alone
            waiting = getattr(generator, "_unprocessed_sequences", ())[:generator.prefill_batch_size]
            if any(sequence[0] in self._media_uids for sequence in waiting):
                generator.prefill_batch_size = 1
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

    def running_cache(self, uid: int) -> Coverage | None:
        return None  # mlx-vlm's batch keeps prefixes in its own block cache

    def close(self) -> None:
        self._generator.close()
        if self._disk is not None:  # what was queued for the SSD tier lands before a stop, for the restart
            self._disk.flush()

    def _embed(self, prompt: list[int], media: PreparedMedia | None, salt: str = "") -> dict[str, Any]:
        """What mlx-vlm's batch takes for one prompt: its embeddings (media features merged
        in) and whatever else the family's language model reads with them (Qwen's rotary
        positions, Qwen 3's deepstack features), and the hash its prefix cache tells media
        apart by. Not the processor's media arrays, which mlx-vlm's server passes on too:
        the batch concatenates every array across its rows, and arrays of two requests'
        media differ in shape (and the language model no longer needs them)."""
        ids = mx.array([prompt])
        if media is None:
            out = self._model.get_input_embeddings(ids)
        else:
            inputs = {name: mx.array(v) if isinstance(v, np.ndarray) else v for name, v in media.inputs.items()}
            pixels = inputs.pop("pixel_values", None)
            visual = pixels is not None or inputs.get("pixel_values_videos") is not None
            key = f"{salt}\x00{media.key}" if salt else media.key  # a salt sees only what its requests cached
            features = self._features(key, pixels, inputs) if visual else None
            cached = {} if features is None else {"cached_image_features": features}
            mask = mx.ones(ids.shape, dtype=mx.int32)  # one row, no padding (what mlx-vlm's processor gives)
            out = self._model.get_input_embeddings(ids, pixels, mask=mask, **inputs, **cached)
        outputs = {k: v for k, v in out.to_dict().items() if v is not None and k not in UNBATCHED_OUTPUTS}
        return {**outputs, "_apc_semantic_hash": _media_hash(media, salt)}

    def _features(self, key: str, pixels: mx.array | None, inputs: dict[str, Any]) -> Any:
        """The vision features of a request's images or videos, from the cache when they
        were seen before; None where the family's are not cached (its tower runs in the merge)."""
        if self._encoder is None:
            return None
        features = self._cache.get(key)
        if features is None:
            features = self._encoder(self._model, pixels, inputs)
            if features is not None:
                self._cache.put(key, features)
        return features


# Families whose media prompts mlx-vlm 0.7.10 prefills wrongly beside other prompts: under
# left padding Qwen 3's deepstack features land on the wrong rows and columns (another
# row's text changes the answer, two image rows fail). Their media prompts prefill alone;
# decoding is batched as for every family.
MEDIA_PREFILLS_ALONE = ("qwen3_vl", "qwen3_vl_moe")

# Embedding outputs mlx-vlm's batch cannot merge across rows and that carry nothing for
# one unpadded row: Gemma 3's 4-D attention mask is the outer product of the all-ones mask.
UNBATCHED_OUTPUTS = ("attention_mask_4d",)


def _media_hash(media: PreparedMedia | None, salt: str = "") -> int:
    """The salt of mlx-vlm's prefix-cache block hashes: blocks holding other media, or
    stored by requests of another `cache_salt`, never match. Given, it spares mlx-vlm
    hashing the prompt's whole embeddings."""
    if media is None and not salt:
        return 0
    key = (media.key if media is not None else "") + (f"\x00{salt}" if salt else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def _dtype(model: Any) -> mx.Dtype:
    """The dtype the model computes keys and values in: its embeddings' (their scales' when quantized)."""
    embed = _embed_tokens(model)
    return getattr(embed, "scales", embed.weight).dtype


def _embed_tokens(model: Any) -> Any:
    language = model.language_model
    return getattr(language, "model", language).embed_tokens


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
