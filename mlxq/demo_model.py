"""Build tiny models offline: a Qwen3-shaped text model that mlx-lm's ordinary `load()`
reads, and vision models of several families that mlx-vlm's `load()` reads
(`demo_vision.py`).

They have random weights but a real byte-level BPE tokenizer (trained here with the
`tokenizers` library), a chat template and eos tokens (and for a vision model its
family's media tokens and processor configs), so every part of the serving path runs
for real without a download. They are small enough (~150k and ~200k parameters) that
the test suite runs quickly on a 2-core CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .demo_parts import (
    CHAT_TEMPLATE,
    DEFAULT_VISION_FAMILY,
    EOS_TOKENS,
    MODEL_CONFIG,
    SIZES,
    SPECIAL_TOKENS,
    THINK_TOKENS,
    THINKING_CHAT_TEMPLATE,
    VOCAB_SIZE,
    special_ids,
    write_model,
    write_tokenizer,
)

__all__ = ["CHAT_TEMPLATE", "DEFAULT_VISION_FAMILY", "MODEL_CONFIG", "SIZES", "SPECIAL_TOKENS", "VOCAB_SIZE", "build",
           "default_path", "ensure", "is_built", "write_tokenizer"]


def default_path() -> Path:
    """Where `mlxq worker` caches the demo model when no model is configured."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "mlxq" / "demo-model"


def is_built(path: Path) -> bool:
    """Whether `path` holds a complete demo model."""
    return all((path / name).exists() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def ensure(path: Path) -> Path:
    """Build the demo model at `path` unless it is already there."""
    if not is_built(path):
        build(path)
    return path


def build(path: Path, seed: int = 0, size: str = "demo", vocab: int = VOCAB_SIZE,
          family: str = DEFAULT_VISION_FAMILY, shape: str = "demo", text_family: str = "qwen3") -> Path:
    """Build the demo model (`demo`), the `bench` size, the `thinking` variant, an
    `embedding` model or a `reranker` (the demo tokenizer; `shape`: demo or bench), a BERT
    `cross-encoder`, the
    `trained` model and its draft (`demo_trained`, minutes) or a `vision` model of
    `family` (`demo_vision.FAMILIES`) into `path`, written atomically (a `demo` or `bench`
    text model of `text_family`: `demo_parts.TEXT_FAMILIES`):
    a crash leaves nothing half-built. A `vocab` above the default trains the tokenizer
    on the standard library's sources, for a realistic vocabulary (structured output's
    mask cost grows with it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=path.parent))
    try:
        if size == "vision":
            from . import demo_vision

            demo_vision.write(staging, family, seed)
        elif size == "trained":
            from . import demo_trained

            write_tokenizer(staging, SPECIAL_TOKENS, CHAT_TEMPLATE)
            demo_trained.write(staging, seed, {**MODEL_CONFIG, "vocab_size": VOCAB_SIZE,
                                               "eos_token_id": special_ids(staging, EOS_TOKENS)})
        elif size in ("embedding", "reranker"):
            write_tokenizer(staging, SPECIAL_TOKENS, CHAT_TEMPLATE)
            _make_pooling(staging, size)
            write_model(staging, seed, SIZES[shape])
        elif size == "cross-encoder":
            _write_cross_encoder(staging, seed)
        elif size == "thinking":
            write_tokenizer(staging, SPECIAL_TOKENS + THINK_TOKENS, THINKING_CHAT_TEMPLATE)
            write_model(staging, seed, MODEL_CONFIG)
        else:
            write_tokenizer(staging, SPECIAL_TOKENS, CHAT_TEMPLATE, vocab)
            write_model(staging, seed, SIZES[size], text_family)
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _make_pooling(out: Path, size: str) -> None:
    """Make the tokenizer and files of a sentence-transformers embedding model as
    Qwen3-Embedding's (last-token pooling, the eos appended to every text, Matryoshka
    sizes), or of a Qwen3-Reranker (whose answer words, "yes" and "no", are single tokens)."""
    from tokenizers import AddedToken, Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    if size == "reranker":
        tokenizer.add_tokens([AddedToken("yes"), AddedToken("no")])
    else:
        eos = ("<|endoftext|>", tokenizer.token_to_id("<|endoftext|>"))
        tokenizer.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                                 pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
                                                                 special_tokens=[eos])
        (out / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": MODEL_CONFIG[
            "hidden_size"], "pooling_mode_lasttoken": True}))
    tokenizer.save(str(out / "tokenizer.json"))


def _write_cross_encoder(out: Path, seed: int) -> None:
    """A BERT cross-encoder (`BertForSequenceClassification`, one relevance logit) with the
    demo tokenizer made BERT's: [CLS] query [SEP] document [SEP], segment ids 0 then 1."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.bert import bert
    from mlx_vlm.models.bert.config import ModelConfig
    from tokenizers import Tokenizer, processors

    special = ["[PAD]", "[CLS]", "[SEP]", *SPECIAL_TOKENS]
    write_tokenizer(out, special, CHAT_TEMPLATE)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    cls, sep = (("[CLS]", tokenizer.token_to_id("[CLS]")), ("[SEP]", tokenizer.token_to_id("[SEP]")))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[cls, sep])
    tokenizer.save(str(out / "tokenizer.json"))
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings.update(pad_token="[PAD]", model_input_names=["input_ids", "token_type_ids", "attention_mask"],
                    model_max_length=512)
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    config = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "num_labels": 1,
              "vocab_size": max(VOCAB_SIZE, tokenizer.get_vocab_size()), "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 512,
              "type_vocab_size": 2, "pad_token_id": tokenizer.token_to_id("[PAD]")}
    mx.random.seed(seed)
    model = bert.SequenceClassificationModel(ModelConfig.from_dict(config))
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=2))


