"""A tiny random-weight vision model in mlx-vlm's format (Gemma 3's architecture), built offline:
for the MLX engine's image tests, where no real vision model can be downloaded.

One directory as mlx-community's Gemma 3 conversions are laid out: ``config.json`` with a
``text_config`` (the language model, which mlx-lm loads) and a ``vision_config`` (a SigLIP
tower, which mlx-vlm loads with the projector), the weights in one safetensors file, the
tokenizer (``tiny_mlx``'s, with Gemma 3's image and turn tokens added) and the processor's
settings: a 56x56 image read as 16 patches, pooled into 4 image tokens. Its answers mean
nothing; two images give different ones. The same arguments always give the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from harness.models.tiny_mlx import make_tokenizer

IMAGE_TOKENS = 4  # per image
IMAGE_SIZE = 56

# Gemma 3's turns; an image part is its <start_of_image>, which the processor makes the image's
# whole sequence.
TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

SPECIAL = [
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "<start_of_turn>",
    "<end_of_turn>",
]


def make_tiny_mlx_vision_model(
    path: Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    n_layers: int = 2,
    vision_hidden_size: int = 32,
    vision_layers: int = 1,
    image_size: int = IMAGE_SIZE,
    image_tokens: int = IMAGE_TOKENS,
) -> Path:
    """Write the model to ``path`` (created) and return it. The sizes are the tests' unless
    given (a bench gives larger ones: an image of ``image_size`` pixels a side, in patches of
    14, pooled into ``image_tokens``, a square number)."""
    from mlx_vlm.models.gemma3.config import ModelConfig, TextConfig, VisionConfig
    from mlx_vlm.models.gemma3.gemma3 import Model

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.save(str(path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL}
    _write(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<end_of_turn>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 2048,
            "chat_template": TEMPLATE,
            # What Gemma 3's processor asks the tokenizer for.
            "extra_special_tokens": {
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
        },
    )
    _write(
        path / "preprocessor_config.json",
        {
            # transformers' own Gemma 3 processing, in PIL and numpy (no torch).
            "image_processor_type": "Gemma3ImageProcessorPil",
            "processor_class": "Gemma3Processor",
            "do_resize": True,
            "size": {"height": image_size, "width": image_size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": True,
            "resample": 2,
        },
    )
    _write(
        path / "processor_config.json",
        {"processor_class": "Gemma3Processor", "image_seq_length": image_tokens},
    )
    text = {
        "model_type": "gemma3_text",
        "hidden_size": hidden_size,
        "num_hidden_layers": n_layers,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
        "vocab_size": vocab,
        "sliding_window": 512,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": hidden_size // 4,
        "rope_theta": 1_000_000.0,
        "rope_global_base_freq": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "mm_tokens_per_image": image_tokens,
        "max_position_embeddings": 2048,
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": vision_hidden_size,
        "num_hidden_layers": vision_layers,
        "intermediate_size": 2 * vision_hidden_size,
        "num_attention_heads": max(2, vision_hidden_size // 64),
        "patch_size": 14,
        "image_size": image_size,
    }
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "vocab_size": vocab,
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "mm_tokens_per_image": image_tokens,
        "eos_token_id": [ids["<end_of_turn>"]],
        "pad_token_id": 0,
        "text_config": text,
        "vision_config": vision,
    }
    _write(path / "config.json", config)

    model_config = ModelConfig.from_dict(config)  # type: ignore[no-untyped-call]
    model_config.text_config = TextConfig.from_dict(text)  # type: ignore[no-untyped-call]
    model_config.vision_config = VisionConfig.from_dict(vision)  # type: ignore[no-untyped-call]
    flat: list[tuple[str, mx.array]] = tree_flatten(Model(model_config).parameters())  # type: ignore[assignment]
    rng = np.random.default_rng(seed)
    weights: dict[str, mx.array] = {}
    for name, param in sorted(flat):
        if "lm_head" in name:  # tied to the token embedding, as Gemma 3's checkpoints are
            continue
        shape = tuple(param.shape)
        if "norm" in name and name.endswith("weight"):
            value = 0.1 * rng.standard_normal(shape)
        elif name.endswith("embed_tokens.weight"):
            value = rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-1])
        weights[name] = mx.array(value.astype(np.float32))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def _write(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2))
