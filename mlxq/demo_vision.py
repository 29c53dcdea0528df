"""Tiny random vision models of several mlx-vlm families, built offline.

Each family gets what a real checkpoint of it has: its special tokens in a trained
byte-level BPE tokenizer, a chat template that places the family's media markers, the
image (and video) processor config its mlx-vlm processor reads, and a `config.json`
that mlx-vlm's own `load()` turns into the family's model. The model itself is built
here the way `load()` builds it, with random weights, so every family runs through
exactly the code a downloaded model would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import demo_parts

# The language models share the text demo model's size; the towers are one block wide.
TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "vocab_size": demo_parts.VOCAB_SIZE}

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_PARTS = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
              "video": "<|vision_start|><|video_pad|><|vision_end|>"}
QWEN_MEAN_STD = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
# Images are resized to between 56x56 and 224x224 pixels: 4 to 64 image tokens.
QWEN_PIXELS = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 56 * 56,
               "max_pixels": 224 * 224, **QWEN_MEAN_STD}
QWEN_TOWER = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 64,
              "num_heads": 2, "mlp_ratio": 2, "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "in_channels": 3, "window_size": 56, "fullatt_block_indexes": [0]}


def chatml_template(parts: dict[str, str]) -> str:
    """The demo ChatML template (with its tool format) where a message's content may be a
    list of text and media parts, each media part written as `parts[type]`."""
    media = "".join(f"{{% elif part['type'] == '{kind}' %}}{marker}" for kind, marker in parts.items())
    return demo_parts.CHAT_TEMPLATE.replace(
        "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}",
        "{% else %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'text' %}}{{{{ part['text'] }}}}{media}{{% endif %}}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endif %}")


@dataclass(frozen=True)
class Family:
    """What one family's checkpoint holds besides its weights."""

    tokens: list[str]  # its special tokens (beside the demo's ChatML ones)
    chat_template: str
    config: Callable[[dict[str, int]], dict[str, Any]]  # config.json, from the special tokens' ids
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # processor configs, by file name
    tokenizer_extra: dict[str, Any] = field(default_factory=dict)  # added to tokenizer_config.json
    eos: list[str] = field(default_factory=lambda: list(demo_parts.EOS_TOKENS))
    embed_scale: float = 1.0  # see demo_parts.save
    # Matrices of these modules scaled down: a family whose projected media features would
    # otherwise drown the text answers every image alike.
    quieter: dict[str, float] = field(default_factory=dict)


def _qwen_config(model_type: str, tower: dict[str, Any], rope: dict[str, Any]) -> Callable[[dict[str, int]], dict]:
    def config(ids: dict[str, int]) -> dict[str, Any]:
        return {**TEXT, "model_type": model_type, "architectures": ["Qwen2VLForConditionalGeneration"],
                "rope_scaling": rope, "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
                "vision_config": {"model_type": model_type, **tower}}
    return config


def _qwen3_config(ids: dict[str, int]) -> dict[str, Any]:
    text = {**TEXT, "model_type": "qwen3_vl", "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                                "mrope_interleaved": True}}
    return {"model_type": "qwen3_vl", "text_config": text, "tie_word_embeddings": True,
            "vision_config": {**QWEN_TOWER, "model_type": "qwen3_vl", "out_hidden_size": 64, "patch_size": 16,
                              "spatial_patch_size": 16, "num_position_embeddings": 64,
                              "deepstack_visual_indexes": [0]},
            "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}


GEMMA_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _gemma3_config(ids: dict[str, int]) -> dict[str, Any]:
    # A 28x28 image is 2x2 patches of 14, pooled to 4 image tokens.
    text = {**TEXT, "model_type": "gemma3_text", "query_pre_attn_scalar": 16, "sliding_window": 64,
            "sliding_window_pattern": 2, "mm_tokens_per_image": 4}
    vision = {"model_type": "siglip_vision_model", "num_hidden_layers": 1, "hidden_size": 32,
              "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 14, "image_size": 28}
    return {"model_type": "gemma3", "text_config": text, "vision_config": vision, "vocab_size": TEXT["vocab_size"],
            "hidden_size": TEXT["hidden_size"], "image_token_index": ids["<image_soft_token>"],
            "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"]}


IDEFICS_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
IDEFICS_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


def _idefics3_config(ids: dict[str, int]) -> dict[str, Any]:
    # One 28x28 image: 2x2 patches of 14, shuffled by the scale factor 2 into 1 token.
    text = {**TEXT, "model_type": "llama"}
    vision = {"model_type": "idefics3", "hidden_size": 32, "num_attention_heads": 2, "patch_size": 14,
              "num_hidden_layers": 1, "intermediate_size": 64, "image_size": 28}
    return {"model_type": "idefics3", "text_config": text, "vision_config": vision, "scale_factor": 2,
            "vocab_size": TEXT["vocab_size"], "image_token_id": ids["<image>"]}


MISTRAL_TOKENS = ["[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}")


def _mistral3_config(ids: dict[str, int]) -> dict[str, Any]:
    # Pixtral's tower over 14-pixel patches, merged 2x2: a 56x56 image is 4 tokens and
    # the [IMG_BREAK] / [IMG_END] markers the processor puts after each row.
    # Heads 32 wide (the others' are 16): mx.quantize groups at least 32 values, so this
    # is the demo family a worker with kv_bits can serve.
    text = {**TEXT, "model_type": "mistral", "rope_theta": 10000.0, "head_dim": 32}
    vision = {"model_type": "pixtral", "num_hidden_layers": 1, "hidden_size": 32, "head_dim": 16,
              "intermediate_size": 64, "num_attention_heads": 2, "image_size": 56, "patch_size": 14}
    return {"model_type": "mistral3", "text_config": text, "vision_config": vision, "spatial_merge_size": 2,
            "image_token_index": ids["[IMG]"], "vocab_size": TEXT["vocab_size"]}


GEMMA4_MARKERS = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                  "audio_token": "<audio_soft_token>", "boa_token": "<start_of_audio>", "eoa_token": "<end_of_audio>",
                  "video_token": "<|video|>"}
GEMMA4_TOKENS = [*GEMMA4_MARKERS.values(), "<start_of_turn>", "<end_of_turn>"]
GEMMA4_TEMPLATE = GEMMA_TEMPLATE.replace(
    "{% if part['type'] == 'image' %}<start_of_image>",
    "{% if part['type'] == 'image' %}<image_soft_token>{% elif part['type'] == 'audio' %}<audio_soft_token>"
    "{% elif part['type'] == 'video' %}<|video|>")


def _gemma4_config(ids: dict[str, int]) -> dict[str, Any]:
    # Images pool 16-pixel patches by 3 into 70 soft tokens (its smallest size); audio is one small
    # conformer block over the processor's mel features.
    text = {**TEXT, "model_type": "gemma4_text", "global_head_dim": 16, "num_kv_shared_layers": 0,
            "vocab_size_per_layer_input": TEXT["vocab_size"], "hidden_size_per_layer_input": 8,
            "sliding_window": 64, "sliding_window_pattern": 2, "use_double_wide_mlp": False}
    vision = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
              "patch_size": 16, "position_embedding_size": 256, "pooling_kernel_size": 3, "default_output_length": 70}
    audio = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "subsampling_conv_channels": [8, 4],
             "output_proj_dims": 64}
    return {"model_type": "gemma4", "text_config": text, "vision_config": vision, "audio_config": audio,
            "vocab_size": TEXT["vocab_size"], "hidden_size": TEXT["hidden_size"],
            "image_token_id": ids["<image_soft_token>"], "audio_token_id": ids["<audio_soft_token>"],
            "video_token_id": ids["<|video|>"], "boi_token_id": ids["<start_of_image>"],
            "eoi_token_id": ids["<end_of_image>"], "boa_token_id": ids["<start_of_audio>"],
            "eoa_token_id": ids["<end_of_audio>"], "vision_soft_tokens_per_image": 70,
            "vision_soft_tokens_per_video_frame": 70}


FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(QWEN_TOKENS, chatml_template(QWEN_PARTS),
                       _qwen_config("qwen2_vl", {**QWEN_TOWER, "embed_dim": 32, "hidden_size": 64},
                                    {"type": "mrope", "mrope_section": [2, 3, 3]}),
                       {"preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessor",
                                                     "processor_class": "Qwen2VLProcessor", **QWEN_PIXELS}}),
    "qwen2_5_vl": Family(QWEN_TOKENS, chatml_template(QWEN_PARTS),
                         _qwen_config("qwen2_5_vl", QWEN_TOWER, {"type": "mrope", "mrope_section": [2, 3, 3]}),
                         {"preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessor",
                                                       "processor_class": "Qwen2_5_VLProcessor", **QWEN_PIXELS}}),
    "qwen3_vl": Family(QWEN_TOKENS, chatml_template(QWEN_PARTS), _qwen3_config,
                       {"preprocessor_config.json": {"image_processor_type": "Qwen3VLImageProcessor",
                                                     "processor_class": "Qwen3VLProcessor", **QWEN_PIXELS,
                                                     "patch_size": 16, "min_pixels": 64 * 64,
                                                     "max_pixels": 256 * 256,
                                                     "size": {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}}}),
    "gemma3": Family(GEMMA_TOKENS, GEMMA_TEMPLATE, _gemma3_config,
                     {"preprocessor_config.json": {"image_processor_type": "Gemma3ImageProcessor",
                                                   "processor_class": "Gemma3Processor",
                                                   "size": {"height": 28, "width": 28}, "do_pan_and_scan": False,
                                                   "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
                      "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": 4}},
                     {"bos_token": "<|endoftext|>",
                      "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                               "image_token": "<image_soft_token>"}},
                     eos=["<end_of_turn>", "<|endoftext|>"], embed_scale=0.05),
    "idefics3": Family(IDEFICS_TOKENS, IDEFICS_TEMPLATE, _idefics3_config,
                       {"preprocessor_config.json": {"image_processor_type": "Idefics3ImageProcessor",
                                                     "processor_class": "Idefics3Processor",
                                                     "do_image_splitting": False, "size": {"longest_edge": 28},
                                                     "max_image_size": {"longest_edge": 28},
                                                     "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
                        "processor_config.json": {"processor_class": "Idefics3Processor", "image_seq_len": 1}},
                       eos=["<end_of_utterance>", "<|endoftext|>"]),
    "mistral3": Family(MISTRAL_TOKENS, MISTRAL_TEMPLATE, _mistral3_config,
                       {"preprocessor_config.json": {"image_processor_type": "PixtralImageProcessor",
                                                     "processor_class": "Mistral3Processor",
                                                     "size": {"longest_edge": 56},
                                                     "patch_size": {"height": 14, "width": 14},
                                                     "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
                        "processor_config.json": {"processor_class": "Mistral3Processor", "image_token": "[IMG]",
                                                  "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
                                                  "patch_size": 14, "spatial_merge_size": 2}},
                       {"bos_token": "<|endoftext|>"}, eos=["<|endoftext|>", "<|im_end|>"]),
    "gemma4": Family(GEMMA4_TOKENS, GEMMA4_TEMPLATE, _gemma4_config,
                     {"processor_config.json": {"processor_class": "Gemma4Processor", "audio_seq_length": 64,
                                                "image_processor": {"patch_size": 16, "max_soft_tokens": 70,
                                                                    "pooling_kernel_size": 3},
                                                "video_processor": {"patch_size": 16, "max_soft_tokens": 70,
                                                                    "pooling_kernel_size": 3}}},
                     {"bos_token": "<|endoftext|>", "extra_special_tokens": GEMMA4_MARKERS},
                     eos=["<end_of_turn>", "<|endoftext|>"], embed_scale=0.05,
                     quieter={"embed_vision": 0.02, "embed_audio": 0.02}),
}


def write(out: Path, family: str, seed: int) -> None:
    """Write a tiny random model of `family` into the empty directory `out`."""
    spec = FAMILIES[family]
    demo_parts.write_tokenizer(out, demo_parts.SPECIAL_TOKENS + spec.tokens, spec.chat_template, eos=spec.eos)
    if spec.tokenizer_extra:
        config_file = out / "tokenizer_config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **spec.tokenizer_extra}, indent=2))
    ids = dict(zip(spec.tokens, demo_parts.special_ids(out, spec.tokens), strict=True))
    config = {**spec.config(ids), "eos_token_id": demo_parts.special_ids(out, spec.eos)}
    from mlx.utils import tree_map

    model = _build_as_mlx_vlm_loads(config, seed)
    for name, factor in spec.quieter.items():
        getattr(model, name).update(tree_map(lambda p, f=factor: p * f if p.ndim == 2 else p,
                                             getattr(model, name).parameters()))
    special = demo_parts.special_ids(out, demo_parts.SPECIAL_TOKENS + spec.tokens)
    language = model.language_model
    demo_parts.save(out, model, getattr(language, "model", language).embed_tokens, special, config,
                    embed_scale=spec.embed_scale)
    for name, content in spec.files.items():
        (out / name).write_text(json.dumps(content, indent=2))


def _build_as_mlx_vlm_loads(config: dict[str, Any], seed: int) -> Any:
    """The family's model from `config`, constructed as mlx-vlm's `load_model` does."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = json.loads(json.dumps(config))  # its own copy: from_dict takes the dicts apart
    model_class, _ = get_model_and_args(config=config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = model_class.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, model_class, config, ["text", "vision", "audio"])
    mx.random.seed(seed)
    model = model_class.Model(model_config)
    model.update(tree_map(_drawn, model.parameters()))
    return model


def _drawn(p: Any) -> Any:
    """A random matrix where a family starts one constant (Gemma 3's projector is all
    ones): a constant projection makes every image feature alike, and so fragile that
    another BLAS's rounding changes a greedy image answer."""
    import mlx.core as mx

    if p.ndim != 2 or p.size < 2 or (p != p.reshape(-1)[0]).any().item():
        return p
    return mx.random.normal(p.shape, dtype=p.dtype) / p.shape[0] ** 0.5
