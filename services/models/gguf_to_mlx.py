"""A llama-architecture GGUF model converted offline to an MLX (mlx-lm) model directory, for
tests and benchmarks on real weights: the quantized tensors dequantized to float32, the
tokenizer rebuilt from the GGUF's vocabulary, merges and chat template.

Only what SmolLM2 needs: byte-level BPE ("gpt2") vocabularies, llama tensors, tied or separate
output layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

_CONTROL = 3  # llama.cpp's token type for special tokens

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _field(reader: gguf.GGUFReader, name: str) -> Any:
    field = reader.get_field(name)
    if field is None:
        raise KeyError(name)
    return field.contents()


def _unpermute(weight: np.ndarray[Any, Any], n_head: int) -> np.ndarray[Any, Any]:
    """Undo llama.cpp's conversion of Q and K rows to interleaved rotary pairs."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_to_mlx(gguf_path: Path, out: Path) -> Path:
    """Write the MLX model directory ``out`` (created) and return it."""
    # Imported here, not with the module: a process that converts and then runs the model has
    # imported an MLX engine first, which loads OpenBLAS before mlx (inference/engines/mlx/blas.py).
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(gguf_path)
    if _field(reader, "general.architecture") != "llama":
        raise ValueError("only llama-architecture GGUF models")
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE vocabularies")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv_head = int(_field(reader, "llama.attention.head_count_kv"))

    weights: dict[str, mx.array] = {}
    n_layers = 0
    for tensor in reader.tensors:
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            layer, kind = int(parts[1]), parts[2]
            n_layers = max(n_layers, layer + 1)
            if kind == "attn_q":
                value = _unpermute(value, n_head)
            elif kind == "attn_k":
                value = _unpermute(value, n_kv_head)
            name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"
        else:
            name = {
                "token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight",
            }[tensor.name]
        weights[name] = mx.array(value)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})

    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    # llama.cpp's "smollm" pre-tokenizer: every digit alone, then GPT-2's byte-level split.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    bos = tokens[int(_field(reader, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": tokens[int(_field(reader, "tokenizer.ggml.padding_token_id"))],
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "model_max_length": int(_field(reader, "llama.context_length")),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))

    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": int(_field(reader, "llama.embedding_length")),
        "num_hidden_layers": n_layers,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "vocab_size": len(tokens),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "eos_token_id": tokens.index(eos),
        "bos_token_id": tokens.index(bos),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
