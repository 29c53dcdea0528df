"""Embedding and reranker models through mlx-vlm's loaders: one pooled forward pass over
a batch of token sequences, on the engine thread.

mlx-vlm 0.7.10 (already the `vision` extra) loads sentence-transformers embedding models
of the families it knows (Qwen3-Embedding, EmbeddingGemma, BGE-M3 / XLM-RoBERTa, BERT,
ModernBERT, LFM2, Ministral; pooling from `1_Pooling`, normalized as they are) and
rerankers: cross-encoders (`...ForSequenceClassification`: BERT, ModernBERT,
XLM-RoBERTa, one relevance logit) and Qwen3-Reranker (a causal model whose score is
P("yes") against "no" after a fixed prompt). Sequences are right-padded: the model's
attention mask hides the padding, and in a causal model nothing before it can see it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from worker.engine.backends.base import Loaded, ModelInfo, PoolingInfo, RerankFormat, Task
from worker.engine.backends.mlx_lm import mlx_memory
from worker.messages import PoolInput
from worker.settings import WorkerSettings

FALLBACK_MAX_LENGTH = 512  # an input's tokens when neither the model nor its tokenizer says


class Pooler:
    """Runs one padded pass: an embedding per sequence (B, D), or a relevance score (B,)."""

    def __init__(self, model: Any, info: PoolingInfo, yes_no: tuple[int, int] | None = None) -> None:
        self.model = model
        self.info = info
        self.yes_no = yes_no  # Qwen3-Reranker's answer tokens

    def __call__(self, batch: Sequence[PoolInput]) -> mx.array:
        width = max(len(item.tokens) for item in batch)
        ids = mx.array([item.tokens + [self.info.pad_id] * (width - len(item.tokens)) for item in batch])
        mask = mx.array([[1] * len(item.tokens) + [0] * (width - len(item.tokens)) for item in batch])
        if self.yes_no is not None:
            return self._qwen3_scores(ids, mask)
        kwargs: dict[str, Any] = {"attention_mask": mask}
        if batch[0].type_ids is not None:
            kwargs["token_type_ids"] = mx.array([(item.type_ids or []) + [0] * (width - len(item.tokens))
                                                 for item in batch])
        out = self.model(ids, **kwargs)
        if self.info.task == "embed":
            return out.text_embeds.astype(mx.float32)
        logits = getattr(out, "logits", out)
        return mx.sigmoid(logits.reshape(-1).astype(mx.float32))

    def _qwen3_scores(self, ids: mx.array, mask: mx.array) -> mx.array:
        language = self.model.language_model
        hidden = language.model(ids)  # causal: right padding is never seen by the real tokens
        last = mask.sum(axis=1) - 1
        pooled = hidden[mx.arange(ids.shape[0]), last]
        head = getattr(language, "lm_head", None)
        logits = head(pooled) if head is not None else language.model.embed_tokens.as_linear(pooled)
        yes, no = self.yes_no  # type: ignore[misc]
        return mx.sigmoid((logits[:, yes] - logits[:, no]).astype(mx.float32))


def load_pooling_model(settings: WorkerSettings, task: Task) -> Loaded:
    """An embedding model or a reranker (a local path or a Hugging Face id), loaded by mlx-vlm, with its `Pooler`."""
    from mlx_vlm.utils import get_model_path, load_processor
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    for setting in ("kv_bits", "ssd_cache_dir", "draft_model", "prompt_lookup_max", "max_kv_size"):
        if getattr(settings, setting):
            raise ValueError(f"{settings.model}: {setting} is a generation setting; this model serves {task}")
    model_dir = Path(get_model_path(str(settings.model)))
    config = _json(model_dir / "config.json")
    if task == "embed":
        model, processor = _embedding_model(model_dir), load_processor(model_dir, add_detokenizer=False)
    else:
        model, processor = _reranker(model_dir)
    tokenizer: Any = getattr(processor, "tokenizer", processor)
    rerank_format: RerankFormat | None = None
    if task == "rerank":
        rerank_format = "classifier" if any(str(a).endswith("ForSequenceClassification")
                                            for a in config.get("architectures") or []) else "qwen3"
    info = PoolingInfo(task, _max_length(config, tokenizer), _pad_id(tokenizer),
                       dimensions=_dimensions(model) if task == "embed" else 0,
                       matryoshka=_matryoshka(config, settings.matryoshka_dimensions), rerank_format=rerank_format)
    yes_no = _yes_no(tokenizer) if rerank_format == "qwen3" else None
    pooler = Pooler(model, info, yes_no)
    pooler([PoolInput([info.pad_id])])  # compiles what a first request would wait on
    model_info = ModelInfo(name=str(settings.model), tokenizer=tokenizer, context_length=info.max_length,
                           vocab_size=int(_text(config).get("vocab_size") or len(tokenizer)), logprobs=False,
                           pooling=info)
    return Loaded(info=model_info, make_backend=_no_batch, new_detokenizer=_no_batch, memory=mlx_memory,
                  release_memory=mx.clear_cache, pooler=pooler)


def _embedding_model(model_dir: Path) -> Any:
    from mlx_vlm.embedding_loader import load_embedding_model
    from mlx_vlm.models.pooling import read_pooling_config

    model = load_embedding_model(model_dir)
    model.pooling_config = read_pooling_config(model_dir)
    return model


def _reranker(model_dir: Path) -> tuple[Any, Any]:
    from mlx_vlm.reranker_loader import load_reranker

    if _json(model_dir / "config.json").get("model_type") == "qwen3_vl":
        raise ValueError("a vision reranker (qwen3_vl) is not served yet; a text one (qwen3) or a cross-encoder is")
    return load_reranker(str(model_dir))  # type: ignore[no-any-return]


def _no_batch() -> Any:
    raise RuntimeError("a pooling model has no generation batch")


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def _max_length(config: dict[str, Any], tokenizer: Any) -> int:
    """The longest input: the model's positions (RoBERTa's start after the pad's, so two
    fewer), and its tokenizer's limit where it sets one."""
    positions = _text(config).get("max_position_embeddings")
    if isinstance(positions, int) and config.get("model_type") in ("xlm-roberta", "roberta", "camembert"):
        positions -= 2
    limits = [v for v in (positions, getattr(tokenizer, "model_max_length", None))
              if isinstance(v, int) and 0 < v < 1_000_000]
    return min(limits) if limits else FALLBACK_MAX_LENGTH


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _dimensions(model: Any) -> int:
    """An embedding's length: the model's answer to one token."""
    probe = model(mx.array([[0]]), attention_mask=mx.array([[1]])).text_embeds
    return int(probe.shape[-1])


def _matryoshka(config: dict[str, Any], configured: list[int] | None) -> bool | tuple[int, ...]:
    """The sizes an embedding may be cut to: the worker's setting (`[0]`: any), else as vLLM
    reads them from the config: `matryoshka_dimensions` (these), or `is_matryoshka` (any)."""
    if configured is not None:
        return True if configured == [0] else tuple(sorted(configured))
    sizes = config.get("matryoshka_dimensions")
    if isinstance(sizes, list) and all(isinstance(s, int) and s > 0 for s in sizes):
        return tuple(sorted(sizes))
    return config.get("is_matryoshka") is True


def _yes_no(tokenizer: Any) -> tuple[int, int]:
    ids = []
    for word in ("yes", "no"):
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"a Qwen3-style reranker needs {word!r} to be one token of its vocabulary")
        ids.append(encoded[0])
    return ids[0], ids[1]
