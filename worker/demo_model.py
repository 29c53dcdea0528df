"""Build a tiny Qwen3-shaped model offline, loadable by mlx-lm's ordinary `load()`.

The model has random weights but a real byte-level BPE tokenizer (trained here with
the `tokenizers` library), a ChatML chat template and eos tokens, so every part of the
serving path runs for real without a download. It is small enough (~150k parameters)
that the test suite runs quickly on a 2-core CPU.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKENS = ["<|im_end|>", "<|endoftext|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MODEL_CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}

# Bigger, for benchmarks: ~25M parameters, where batching and the BLAS show up.
BENCH_CONFIG = {**MODEL_CONFIG, "hidden_size": 512, "num_hidden_layers": 6, "intermediate_size": 2048,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
SIZES = {"demo": MODEL_CONFIG, "bench": BENCH_CONFIG}

VOCAB_SIZE = 1024

# Modules whose docstrings make the tokenizer's training text: always on disk, no
# download, and ordinary English prose plus code.
_CORPUS_MODULES = [
    "asyncio", "collections", "json", "pathlib", "logging",
    "argparse", "dataclasses", "functools", "itertools", "re", "string", "textwrap",
]


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


def build(path: Path, seed: int = 0, size: str = "demo") -> Path:
    """Build the demo model (or the `bench` size) into `path`, written atomically: a crash
    leaves nothing half-built."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=path.parent))
    try:
        _write_tokenizer(staging)
        _write_model(staging, seed, SIZES[size])
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _corpus() -> list[str]:
    texts: list[str] = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        values = [module, *(v for v in vars(module).values() if inspect.isfunction(v) or inspect.isclass(v))]
        texts.extend(v.__doc__ for v in values if isinstance(v.__doc__, str))
    return texts


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    eos_ids = [tokenizer.token_to_id(t) for t in EOS_TOKENS]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKENS[0],
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))


def _write_model(out: Path, seed: int, shape: dict[str, object]) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import qwen3
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    eos_ids = [tokenizer.token_to_id(t) for t in EOS_TOKENS]
    config = {**shape, "vocab_size": vocab_size, "eos_token_id": eos_ids}

    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    # Default init gives a near-identity residual stream, and greedy decoding then
    # repeats one token forever. Larger matrices make varied text, which the tests
    # need to tell requests apart.
    model.update(tree_map(lambda p: p * 6.0 if p.ndim == 2 else p, model.parameters()))
    # With tied embeddings a zero row gives its token a logit of exactly 0, so random
    # weights never pick a special token greedily and generations do not end at once.
    special = mx.array([tokenizer.token_to_id(t) for t in SPECIAL_TOKENS])
    embed = model.model.embed_tokens
    embed.weight = embed.weight.at[special].multiply(0.0)
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=2))
