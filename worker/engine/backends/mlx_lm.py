"""Text models through mlx-lm: loading, and its BatchGenerator behind `BatchBackend`.

Its API moves between minor releases, so only this module touches it; the engine and
its tests see `BatchBackend`, which a fake can implement without a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import LogitsProcessor, Sampler, greedy_sampler

from worker.engine.adapters import AdapterBank
from worker.engine.adapters.layers import AdapterRows
from worker.engine.backends.base import BatchBackend, Coverage, Loaded, ModelInfo, TokenOut
from worker.engine.backends.draft_model import DraftModel
from worker.engine.backends.lean_batch import LeanGenerationBatch
from worker.engine.backends.prompt_lookup import PromptLookup
from worker.engine.backends.speculative import Gate, Proposer, SpeculationStats, SpeculativeGenerationBatch
from worker.engine.prefix_cache import Mirror, PrefixCache
from worker.engine.sampling import warm_up
from worker.engine.scheduler import StepPlan
from worker.faults import Faults
from worker.messages import PreparedMedia
from worker.settings import WorkerSettings


class MlxBatchBackend:
    """`BatchBackend` over mlx-lm 0.32's BatchGenerator, stepped to the scheduler's plan.

    BatchGenerator's step decodes every running sequence and prefills a chunk of up to
    `prefill_step_size` tokens of each of up to `prefill_batch_size` prompts: eight new
    300-token prompts make one step of 2,400 prompt tokens, and every running stream
    waits for it. Before each step those two knobs are set to the plan's, which keeps
    the step within the scheduler's token budget (`scheduler.StepBudget`).
    """

    def __init__(self, model: Any, *, completion_batch_size: int, prefill_batch_size: int,
                 prefill_step_size: int, max_kv_size: int | None = None,
                 speculative: SpeculativeGenerationBatch | None = None, adapters: AdapterBank | None = None) -> None:
        # With adapters, the batch runs the model through their wrapper, and every
        # sequence's cache list ends with its adapter slot (`adapters.layers`).
        self._model, self._max_kv_size, self._adapters = model, max_kv_size, adapters
        batched: Any = model if adapters is None else adapters.model
        self._generator = BatchGenerator(batched, completion_batch_size=completion_batch_size,
                                         prefill_batch_size=prefill_batch_size,
                                         prefill_step_size=prefill_step_size, max_kv_size=max_kv_size)
        # The one generation batch, which each prefilled group joins.
        self._lean = LeanGenerationBatch.lean(batched, self._generator.sampler) if speculative is None else None
        self._generator._generation_batch = self._lean if speculative is None else speculative
        self._speculative = speculative
        # No stop sequences, not even eos: each request's stop tokens (eos unless it says
        # ignore_eos, its stop_token_ids) are the engine's to act on, like its stop strings.
        self._no_stops = StopSequences([])

    def insert(self, prompt: list[int], max_tokens: int, sampler: Sampler,
               logits_processors: list[LogitsProcessor], cached: Coverage | None = None,
               media: PreparedMedia | None = None, logprobs: bool = False, speculative: bool = True,
               cache_salt: str = "", adapter: int = 0) -> int:
        assert media is None, "a text model takes no media"
        cache = None if cached is None else cached.cache
        if self._adapters is not None:
            cache = (cache or make_prompt_cache(self._model, self._max_kv_size)) + [AdapterRows.one(adapter)]
        (uid,) = self._generator.insert([prompt], max_tokens=[max_tokens], samplers=[sampler],
                                        logits_processors=[logits_processors], stop_sequences=[self._no_stops],
                                        caches=None if cache is None else [cache],
                                        all_tokens=None if cached is None else [cached.tokens])
        if self._speculative is not None and speculative and sampler is greedy_sampler and not logprobs:
            self._speculative.eligible.add(uid)
        if self._lean is not None and logprobs:
            self._lean.wants_logprobs.add(uid)
        return uid

    def remove(self, uids: Iterable[int], keep_caches: bool = False) -> dict[int, Coverage]:
        uids = list(uids)
        if self._speculative is not None:
            self._speculative.eligible.difference_update(uids)
        if self._lean is not None:
            self._lean.wants_logprobs.difference_update(uids)
        caches = self._generator.remove(uids, return_prompt_caches=keep_caches)
        return {uid: self._coverage(uid, cache, tokens) for uid, (cache, tokens) in (caches or {}).items()}

    def step(self, plan: StepPlan) -> list[TokenOut]:
        self._generator.prefill_step_size, self._generator.prefill_batch_size = plan.prefill_chunk, plan.prefill_prompts
        _, generated = self._generator.next()
        ended = [r.uid for r in generated if r.finish_reason]  # they leave the batch by themselves
        if self._speculative is not None:
            self._speculative.eligible.difference_update(ended)
        if self._lean is not None:
            self._lean.wants_logprobs.difference_update(ended)
        return [TokenOut(r.uid, r.token, r.finish_reason,
                         None if r.prompt_cache is None else self._coverage(r.uid, r.prompt_cache, r.all_tokens),
                         logprobs=r.logprobs)
                for r in generated]

    def running_cache(self, uid: int) -> Coverage | None:
        found = self._generator.extract_cache([uid]).get(uid)
        return None if found is None else self._coverage(uid, *found)

    def _coverage(self, uid: int, cache: list[Any], tokens: list[int]) -> Coverage:
        """A finished sequence's KV caches, without its adapter slot (a cached prefix is
        reused under a slot of its own)."""
        return Coverage(cache if self._adapters is None else cache[:-1], list(tokens), row=uid)

    def upcoming_tokens(self) -> dict[int, int]:
        return upcoming_tokens(self._generator)

    def close(self) -> None:
        self._generator.close()


def upcoming_tokens(generator: Any) -> dict[int, int]:
    """Each decoding sequence's next input token, by uid. mlx-lm's BatchGenerator and
    mlx-vlm's both keep them in their generation batch (`uids`, `_next_tokens`); {} if a
    release moves them (the masks are then filled row by row, as before)."""
    batch = getattr(generator, "_generation_batch", None)
    uids, tokens = getattr(batch, "uids", None), getattr(batch, "_next_tokens", None)
    if not uids or tokens is None:
        return {}
    values = tokens.tolist()
    return dict(zip(uids, values, strict=True)) if len(values) == len(uids) else {}


def load_text_model(settings: WorkerSettings, sharded: Sharded | None = None) -> Loaded:
    """Load model and tokenizer (a local path or a Hugging Face id) through mlx-lm's
    `load()`, or this process's shard of them (a worker group's rank 0: `sharded`)."""
    from mlx_lm import load

    path = settings.model
    assert path is not None
    if (settings.prompt_lookup_max or settings.draft_model) and settings.max_kv_size is not None:
        raise ValueError(f"{path}: speculative decoding cannot drop rejected drafts from a rotating cache "
                         "(max_kv_size); unset one of them")
    model, tokenizer, config = load(path, return_config=True) if sharded is None \
        else sharded.load(path)  # type: ignore[misc]
    text_config: dict[str, Any] = config.get("text_config", config)  # type: ignore[union-attr,assignment]
    context = text_config.get("max_position_embeddings") or getattr(tokenizer, "model_max_length", 0) or 4096
    info = ModelInfo(name=path, tokenizer=tokenizer,
                     context_length=int(context), vocab_size=int(text_config.get("vocab_size", len(tokenizer))))
    warm_up(info.vocab_size)

    speculating = bool(settings.prompt_lookup_max or settings.draft_model)
    draft = load_draft(settings.draft_model, tokenizer, info.vocab_size) if settings.draft_model else None
    adapters = None if speculating or sharded or not settings.max_loras else load_adapters(model, settings)
    # Across backends (one is made anew after a failed step); a test hook can pin it to speculate.
    stats, gate = SpeculationStats(), Gate(adaptive=not Faults.from_environment().always_speculate)

    def make_backend() -> BatchBackend:
        if sharded is not None:
            return sharded.backend(plain_backend(model, settings))
        speculative = None
        if speculating:
            proposer: Proposer = PromptLookup(settings.prompt_lookup_max) if draft is None \
                else DraftModel(draft, info.vocab_size)
            speculative = SpeculativeGenerationBatch.empty(model, greedy_sampler).configure(
                proposer, settings.num_draft_tokens, set(), stats, gate)
        return plain_backend(model, settings, speculative, adapters)

    return Loaded(info=info, make_backend=make_backend, new_detokenizer=lambda: tokenizer.detokenizer,
                  prefix_cache=PrefixCache(settings.cache_budget_bytes(), settings.cache_max_entries, mirror=sharded),
                  adapters=adapters,
                  memory=mlx_memory, release_memory=mx.clear_cache,
                  speculation=(lambda: {"method": "ngram" if draft is None else "draft_model", **stats.as_json(),
                                        "tok_s": gate.as_json()}) if speculating else None)


class Sharded(Mirror, Protocol):
    """How a worker group's rank 0 loads its shard and drives its batch in step with the
    other ranks (`worker.process.group`), which keep their shards of its prefix cache's
    entries (the cache's `Mirror`)."""

    def load(self, path: str) -> tuple[Any, Any, dict[str, Any]]:
        """This rank's shard of the model, its tokenizer and its config."""
        ...

    def backend(self, plain: MlxBatchBackend) -> BatchBackend:
        """The batch the engine drives: `plain`, with each change told to the other ranks."""
        ...


def plain_backend(model: Any, settings: WorkerSettings, speculative: SpeculativeGenerationBatch | None = None,
                  adapters: AdapterBank | None = None) -> MlxBatchBackend:
    """mlx-lm's batch, as the settings size it."""
    return MlxBatchBackend(model, completion_batch_size=settings.completion_batch_size,
                           prefill_batch_size=settings.prefill_batch_size,
                           prefill_step_size=settings.prefill_step_size, max_kv_size=settings.max_kv_size,
                           speculative=speculative, adapters=adapters)


def load_adapters(model: Any, settings: WorkerSettings) -> AdapterBank:
    """The model's adapter bank, with the settings' adapters read. One that cannot be
    served is left out, loudly: the model and the other adapters still serve."""
    bank = AdapterBank(model, settings.max_loras, settings.max_lora_rank, settings.max_loaded_adapters)
    bank.serve({entry.name: entry.path for entry in settings.adapters})
    return bank


def load_draft(path: str, tokenizer: Any, vocab_size: int) -> Any:
    """The draft model at `path`, refused unless it shares the model's tokenizer and can
    drop rejected tokens from its caches."""
    from mlx_lm import load

    from worker.engine.backends.draft_model import refusal

    draft, draft_tokenizer = load(path)[:2]
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"draft_model {path}: its tokenizer is not the model's (their vocabularies differ), "
                         "so its tokens would mean other words; use a draft of the same family")
    why = refusal(draft)
    if why is not None:
        raise ValueError(f"draft_model {path} cannot draft in the batch: {why}")
    return draft


def mlx_memory() -> dict[str, int]:
    """MLX's memory figures, in bytes, for the heartbeat."""
    return {"active": mx.get_active_memory(), "peak": mx.get_peak_memory(), "cache": mx.get_cache_memory()}
