"""A tiny random-weight model in MLX (mlx-lm) format, built offline: for the MLX engine's tests
and benches, and to try an MLX pipeline without downloading a model.

Llama architecture, a byte-level BPE tokenizer trained on a short text (with ChatML special
tokens and chat template), and seeded weights scaled so that the logits are well spread: greedy
choices are then far from ties, and any difference in computation shows as different tokens.
The same arguments always give the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Some text for the tokenizer's merges; the non-ASCII words give tokens whose bytes are parts
# of UTF-8 characters.
TEXT = """\
The quick brown fox jumps over the lazy dog. The sea is calm tonight, the tide is full.
Once upon a time there was a small model that could only say a few words, and it said them
again and again: hello, hello world, the world is round, the sea is blue.
Café, naïve, façade, jalapeño, Größe, smørrebrød. 日本語のテキスト、中文文本。 Ünïcödé 🙂🚀.
What is the capital city of France? Paris is the capital city of France.
User: hi. Assistant: hello! How can I help you today? I can count: one two three four five.
"""


def make_tokenizer(vocab_size: int = 400) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TEXT] * 4, trainer)
    return tokenizer


def make_tiny_mlx_model(
    path: Path,
    *,
    n_layers: int = 4,
    hidden_size: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    chat_template: bool = True,
    seed: int = 0,
) -> Path:
    """Write the model to ``path`` (created) and return it."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    eos, im_end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    tokenizer_config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 2048,
    }
    if chat_template:
        tokenizer_config["chat_template"] = CHATML
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))

    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": n_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        # Both end tokens end generation: <|endoftext|> from here, <|im_end|> as the
        # tokenizer's own EOS.
        "eos_token_id": [eos],
        "bos_token_id": None,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    assert im_end is not None

    # The names and shapes the mlx-lm model expects; the values come from numpy's seeded
    # generator, in name order, so they do not depend on how mlx initialises modules.
    args = ModelArgs.from_dict(config)  # type: ignore[no-untyped-call]
    flat: list[tuple[str, mx.array]] = tree_flatten(Model(args).parameters())  # type: ignore[assignment]
    shapes = {name: tuple(value.shape) for name, value in flat}
    rng = np.random.default_rng(seed)
    weights: dict[str, mx.array] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            value = rng.standard_normal(shape)
        elif name == "lm_head.weight":
            # Logits with a standard deviation of about 8.
            value = rng.standard_normal(shape) * 8.0 / np.sqrt(shape[1])
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-1])
        weights[name] = mx.array(value.astype(np.float32)).astype(getattr(mx, dtype))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path
