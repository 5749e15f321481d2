"""GGUF metadata of the real built-in models, checked against the gguf package's reader."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader, GGUFValueType

from events.units import MiB
from modelfiles.gguf_header import SkippedArray, read_gguf_fields
from services.models.footprint import Footprint, engine_overhead_bytes
from services.models.metadata import (
    OVERHEAD_FIXED_BYTES,
    OVERHEAD_PER_VOCAB_BYTES,
    TORCH_RUNTIME_BYTES,
    GgufError,
    kv_cache_bytes,
    model_facts,
    read_gguf,
)
from tests.tiny_diffusion import tiny_diffusion_pipeline


def test_smollm2(smollm2_path: Path) -> None:
    info = read_gguf(smollm2_path)
    assert info.architecture == "llama"
    assert (info.n_layers, info.context_length) == (30, 8192)
    assert (info.n_embd, info.n_head, info.n_head_kv, info.head_dim) == (576, 9, 3, 64)
    assert info.key_length == info.value_length == 64
    assert info.vocab_size == 49152
    assert info.file_type == "Q4_1"
    assert info.tensor_types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert info.n_tensors == 272
    assert info.size_bytes == smollm2_path.stat().st_size == 98_362_432
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template
    assert info.sliding_window is None


def test_gemma3(gemma_path: Path) -> None:
    info = read_gguf(gemma_path)
    assert info.architecture == "gemma3"
    assert (info.n_layers, info.context_length) == (18, 32768)
    assert (info.n_embd, info.n_head, info.n_head_kv) == (640, 4, 1)
    # Gemma's heads are wider than n_embd / n_head: the file's key_length is what counts.
    assert info.key_length == info.value_length == info.head_dim == 256
    assert info.vocab_size == 262144  # no gemma3.vocab_size key: the token list's length
    assert info.file_type == "Q4_K_M"
    assert info.sliding_window == 512
    assert info.chat_template is None  # hence the card's chat_format="gemma"
    assert info.size_bytes == 253_113_024


def test_reading_is_fast(gemma_path: Path) -> None:
    # GGUFReader takes about 9 s on this file (it builds numpy objects for the vocabulary).
    start = time.perf_counter()
    read_gguf(gemma_path)
    assert time.perf_counter() - start < 1.0


def _reference(field: Any) -> Any:
    if field.types[0] == GGUFValueType.ARRAY and len(field.data) > 4096:
        return SkippedArray(len(field.data))
    value = field.contents()
    if field.types[-1] == GGUFValueType.FLOAT32:  # compare at float32 precision
        return [round(v, 6) for v in value] if isinstance(value, list) else round(value, 6)
    if field.types[-1] == GGUFValueType.BOOL:
        return [bool(v) for v in value] if isinstance(value, list) else bool(value)
    return value


def test_every_field_matches_the_gguf_reader(smollm2_path: Path) -> None:
    reader = GGUFReader(smollm2_path)
    expected = {
        key: _reference(field)
        for key, field in reader.fields.items()
        if key.startswith(("general.", "llama.", "tokenizer."))
    }
    ours = {k: v for k, v in read_gguf_fields(smollm2_path).items() if not k.startswith("GGUF.")}
    ours = {k: round(v, 6) if isinstance(v, float) else v for k, v in ours.items()}
    assert ours == expected
    assert read_gguf(smollm2_path).n_tensors == len(reader.tensors)


def footprint_of(path: Path) -> Footprint:
    """What placement counts for the model at ``path`` (its ModelAdded's facts)."""
    facts = model_facts(path)
    return Footprint(
        n_layers=facts.n_layers,
        weights_bytes=facts.size_bytes,
        kv_bytes_per_token=facts.kv_bytes_per_token,
        overhead_bytes=facts.overhead_bytes,
    )


def test_kv_cache_and_memory_need(smollm2_path: Path, gemma_path: Path) -> None:
    smol, gemma = read_gguf(smollm2_path), read_gguf(gemma_path)
    # 2 (K and V) * layers * n_ctx * kv heads * head dim * 2 bytes (f16)
    assert kv_cache_bytes(smol, 2048) == 2 * 30 * 2048 * 3 * 64 * 2 == 45 * MiB
    assert kv_cache_bytes(gemma, 2048) == 2 * 18 * 2048 * 1 * 256 * 2 == 36 * MiB
    assert kv_cache_bytes(smol, 2048, bytes_per_elem=1) == kv_cache_bytes(smol, 1024)

    need = footprint_of(smollm2_path).need_bytes(2048)
    overhead = OVERHEAD_FIXED_BYTES + OVERHEAD_PER_VOCAB_BYTES * 49152
    assert need == smol.size_bytes + 45 * MiB + overhead
    # Measured with llama-cpp-python (RSS after load and one generation): 162 MiB at n_ctx
    # 2048 for SmolLM2, 338 MiB for Gemma 3. The estimate covers both without doubling them.
    assert 162 * MiB <= need <= 250 * MiB
    assert 338 * MiB <= footprint_of(gemma_path).need_bytes(2048) <= 450 * MiB


def test_model_facts_give_placement_the_same_need(smollm2_path: Path) -> None:
    facts, footprint = model_facts(smollm2_path), footprint_of(smollm2_path)
    info = read_gguf(smollm2_path)
    overhead = engine_overhead_bytes(info.vocab_size)
    assert footprint.need_bytes(2048) == info.size_bytes + kv_cache_bytes(info, 2048) + overhead
    # Half the layers: half the weights and KV cache, all of the engine's overhead.
    half = footprint.need_bytes(2048, layers=15) - facts.overhead_bytes
    assert half * 2 - (footprint.need_bytes(2048) - facts.overhead_bytes) in (0, 1)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("just some text, long enough to have a header's worth of bytes\n")
    with pytest.raises(GgufError, match="is not a GGUF file"):
        read_gguf(text)
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"GGUF")
    with pytest.raises(GgufError, match="not a GGUF file"):
        read_gguf(tiny)
    with pytest.raises(GgufError, match="no such file"):
        read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(GgufError, match="not a file"):
        read_gguf(tmp_path)


def test_a_truncated_gguf_is_a_clear_error(smollm2_path: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as f:
        cut.write_bytes(f.read(4000))  # inside the vocabulary
    with pytest.raises(GgufError, match="truncated"):
        read_gguf(cut)


def test_mlx_directory(tmp_path: Path) -> None:
    model = tmp_path / "qwen-mlx"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": 24, "max_position_embeddings": 32768})
    )
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    facts = model_facts(model, "mlx")
    assert (facts.n_layers, facts.context_length, facts.size_bytes) == (24, 32768, 1000)
    assert facts.kv_bytes_per_token == 0  # no head counts in this config: unknown
    assert facts.chat_template == "{{ x }}"
    assert not facts.vision

    # A multimodal config keeps the language model's numbers in text_config.
    text = {
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "vocab_size": 1000,
    }
    (model / "config.json").write_text(json.dumps({"text_config": text}))
    facts = model_facts(model, "mlx")
    assert facts.n_layers == 26
    # K and V, 26 layers, 2 KV heads of 512 / 8 = 64, f16
    assert facts.kv_bytes_per_token == 2 * 26 * 2 * 64 * 2
    assert facts.overhead_bytes == OVERHEAD_FIXED_BYTES + OVERHEAD_PER_VOCAB_BYTES * 1000
    assert not facts.vision
    # With a vision tower (mlx-vlm's layout): it reads images.
    (model / "config.json").write_text(json.dumps({"text_config": text, "vision_config": {}}))
    assert model_facts(model, "mlx").vision

    with pytest.raises(GgufError, match=r"config\.json"):
        model_facts(tmp_path, "mlx")
    with pytest.raises(GgufError, match="directory"):
        model_facts(model, "llamacpp")


def test_model_facts_of_a_gguf(smollm2_path: Path) -> None:
    facts = model_facts(smollm2_path)
    assert (facts.n_layers, facts.context_length, facts.size_bytes) == (30, 8192, 98_362_432)


def test_a_diffusers_pipeline_is_one_layer_its_weights_and_an_image_s_activations(
    tmp_path: Path,
) -> None:
    """What placement counts for an image model: every component's weights, and PyTorch's own
    memory with the activations of one 1024 x 1024 image at the VAE's widest block."""
    pipeline = tiny_diffusion_pipeline()
    facts = model_facts(pipeline, "diffusers")
    weights = sum(f.stat().st_size for f in pipeline.rglob("*.safetensors"))
    assert (facts.n_layers, facts.context_length, facts.kv_bytes_per_token) == (1, 0, 0)
    assert facts.size_bytes == weights
    # The tiny VAE's widest block has 4 channels: four float32 tensors of them at every pixel.
    assert facts.overhead_bytes == TORCH_RUNTIME_BYTES + 4 * 4 * 1024 * 1024 * 4
    with pytest.raises(GgufError, match=r"model_index\.json"):
        model_facts(tmp_path, "diffusers")
