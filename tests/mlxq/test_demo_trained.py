"""`mlxq demo-model --trained`: MLX's own training loop learns the standard library's
sources, and what it writes is a model and a draft that mlx-lm's `load()` reads. (The
full build trains for minutes; here a few steps.)"""

from __future__ import annotations

import pytest

from mlxq import demo_model, demo_trained

pytestmark = pytest.mark.process  # trains a model: not in make test-fast


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    demo_model.write_tokenizer(out, demo_model.SPECIAL_TOKENS, demo_model.CHAT_TEMPLATE)
    return out, demo_trained.corpus_tokens(out)


def held_out_loss(model, tokens) -> float:
    import mlx.core as mx
    import mlx.nn as nn

    window = mx.array(tokens[-(16 * 64 + 1):])
    inputs, targets = window[:-1].reshape(16, 64), window[1:].reshape(16, 64)
    return nn.losses.cross_entropy(model(inputs), targets, reduction="mean").item()


def test_training_lowers_the_loss(tokenized):
    _, tokens = tokenized
    config = {**demo_model.MODEL_CONFIG, **demo_trained.DRAFT, "vocab_size": demo_model.VOCAB_SIZE}
    untrained, trained = (demo_trained.train(config, tokens[:-2000], seed=0, steps=steps) for steps in (1, 60))
    assert held_out_loss(trained, tokens) < held_out_loss(untrained, tokens) - 1.0


def test_the_model_and_its_draft_load_through_mlx_lm(tokenized):
    from mlx_lm import load

    out, _ = tokenized
    base = {**demo_model.MODEL_CONFIG, "vocab_size": demo_model.VOCAB_SIZE}
    demo_trained.write(out, seed=0, base_config=base, steps=2)
    target, tokenizer = load(str(out))[:2]
    draft, draft_tokenizer = load(str(out / "draft"))[:2]
    assert target.args.head_dim == draft.args.head_dim == 32  # groups mx.quantize can take
    assert len(target.layers) > len(draft.layers)
    assert tokenizer.encode("def f(x):") == draft_tokenizer.encode("def f(x):")
