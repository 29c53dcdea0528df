"""The pieces every tiny model is made of: the tokenizer (a byte-level BPE trained here),
its special tokens and chat templates, the Qwen3-shaped configs, and writing weights in
mlx-lm's layout. `demo_model` builds the text models from them, `demo_vision` and
`demo_trained` the others."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKENS = ["<|im_end|>", "<|endoftext|>"]

# ChatML; with `tools`, Qwen2.5's tool format (a <tools> list in a system turn, calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>), which mlx-lm reads with its
# `json_tools` parser.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions.\n\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined %}<|im_start|>assistant\n"
    "{% for tool_call in message['tool_calls'] %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{{ tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A thinking model: reasoning between <think> and </think> (single tokens, as mlx-lm's
# tokenizer wrapper recognises them). As DeepSeek-R1's template does, the assistant turn
# opens the reasoning block; `enable_thinking: false` closes it empty (as Qwen3's does).
THINK_TOKENS = ["<think>", "</think>"]
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}")

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
DEFAULT_VISION_FAMILY = "qwen2_vl"

VOCAB_SIZE = 1024

# Modules whose docstrings make the tokenizer's training text: always on disk, no
# download, and ordinary English prose plus code.
_CORPUS_MODULES = [
    "asyncio", "collections", "json", "pathlib", "logging",
    "argparse", "dataclasses", "functools", "itertools", "re", "string", "textwrap",
]


def _corpus() -> list[str]:
    texts: list[str] = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        values = [module, *(v for v in vars(module).values() if inspect.isfunction(v) or inspect.isclass(v))]
        texts.extend(v.__doc__ for v in values if isinstance(v.__doc__, str))
    return texts


def stdlib_sources(limit_bytes: int = 40_000_000) -> Any:
    """The standard library's Python sources, up to `limit_bytes`: always on disk."""
    import sysconfig

    seen = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(errors="replace")
        seen += len(text)
        if seen > limit_bytes:
            return
        yield text


def write_tokenizer(out: Path, special_tokens: list[str], chat_template: str, vocab: int = VOCAB_SIZE,
                    eos: list[str] = EOS_TOKENS) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus() if vocab <= VOCAB_SIZE else stdlib_sources(), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    eos_ids = [tokenizer.token_to_id(t) for t in eos]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos[0],
        "pad_token": "<|endoftext|>",
        "chat_template": chat_template,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))


def special_ids(out: Path, tokens: list[str]) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [tokenizer.token_to_id(t) for t in tokens]
    assert None not in ids, f"the tokenizer lacks one of {tokens}"
    return ids  # type: ignore[return-value]


# Text families of the same shape: Qwen3 (the default), and those mlx-lm shards a second
# way: Llama (tensor parallel) and Qwen2 (tensor and pipeline parallel).
TEXT_FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def write_model(out: Path, seed: int, shape: dict[str, object], family: str = "qwen3") -> None:
    import importlib

    import mlx.core as mx
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    config = {**shape, "vocab_size": max(VOCAB_SIZE, vocab), "eos_token_id": special_ids(out, EOS_TOKENS),
              "model_type": family, "architectures": [TEXT_FAMILIES[family]]}
    if (out / "modules.json").exists():  # an embedding model: any size may be cut from its vectors
        config.update(architectures=["Qwen3Model"], is_matryoshka=True)
    mx.random.seed(seed)
    models = importlib.import_module(f"mlx_lm.models.{family}")
    model = models.Model(models.ModelArgs.from_dict(config))
    save(out, model, model.model.embed_tokens, special_ids(out, SPECIAL_TOKENS), config)


def save(out: Path, model: Any, embed: Any, special: list[int], config: dict[str, Any],
         embed_scale: float = 1.0) -> None:
    """Write `model`'s weights, made varied (see below), and its `config`; `embed_scale`
    evens out a family that scales its token embeddings up (Gemma's by sqrt(hidden))."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    # Default init gives a near-identity residual stream, and greedy decoding then
    # repeats one token forever. Larger matrices make varied text, which the tests
    # need to tell requests apart.
    model.update(tree_map(lambda p: p * 6.0 if p.ndim == 2 else p, model.parameters()))
    # With tied embeddings a zero row gives its token a logit of exactly 0, so random
    # weights never pick a special token greedily and generations do not end at once.
    embed.weight = (embed.weight * embed_scale).at[mx.array(special)].multiply(0.0)
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    # The index a sharded checkpoint has: mlx-lm's pipeline-parallel load reads it to
    # find each rank's weights.
    index = {"metadata": {"total_size": sum(w.nbytes for w in weights.values())},
             "weight_map": {name: "model.safetensors" for name in sorted(weights)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
