"""A small model trained here, offline, so that speed and agreement figures mean
something: random weights accept almost no drafts and drift from themselves at once.

`mlxq demo-model --trained PATH` trains a Qwen3-shaped model (2 layers, 128 wide, heads
32 wide, which `mx.quantize` can group) and, in PATH/draft, a one-layer draft with the
same tokenizer, both on the standard library's Python sources with MLX's own training
loop (AdamW, next-token cross-entropy), in a few minutes on 2 cores. Code is
predictable: the trained model continues it with stretches its draft gets right, and
copies names from its prompt (what prompt lookup proposes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TARGET = {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32}
DRAFT = {"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 192, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32}
STEPS, BATCH, SEQUENCE, LEARNING_RATE = 400, 16, 128, 3e-3
CORPUS_BYTES = 2_000_000


def write(out: Path, seed: int, base_config: dict[str, Any], steps: int = STEPS) -> None:
    """Train the model into `out` and its draft into `out/draft`; `out` holds the
    tokenizer already (the demo model's)."""
    import shutil

    tokens = corpus_tokens(out)
    draft = out / "draft"
    draft.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(out / name, draft / name)
    for where, shape in ((out, TARGET), (draft, DRAFT)):
        config = {**base_config, **shape}
        model = train(config, tokens, seed, steps)
        _save(where, model, config)


def corpus_tokens(out: Path) -> Any:
    """The standard library's sources in the model's tokens (a few MB: always on disk)."""
    import numpy as np
    from tokenizers import Tokenizer

    from .demo_parts import stdlib_sources

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    texts = list(stdlib_sources(CORPUS_BYTES))
    ids = [token for encoding in tokenizer.encode_batch(texts) for token in encoding.ids]
    return np.array(ids, dtype=np.int32)


def train(config: dict[str, Any], tokens: Any, seed: int, steps: int) -> Any:
    """A Qwen3 of `config`, trained on random windows of `tokens`."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm.models import qwen3

    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    optimizer = optim.AdamW(learning_rate=optim.cosine_decay(LEARNING_RATE, steps, 1e-4), weight_decay=0.01)

    def loss(model: Any, inputs: mx.array, targets: mx.array) -> mx.array:
        return nn.losses.cross_entropy(model(inputs), targets, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - SEQUENCE - 1, BATCH)
        windows = mx.array(np.stack([tokens[s:s + SEQUENCE + 1] for s in starts]))
        _, grads = loss_and_grad(model, windows[:, :-1], windows[:, 1:])
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
    return model


def _save(out: Path, model: Any, config: dict[str, Any]) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=2))
