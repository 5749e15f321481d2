"""Embedding vectors on the wire: base64 of float32 little-endian, one vector after the other.

It is what OpenAI's ``encoding_format: "base64"`` sends, and a quarter of the size of JSON
floats, so that a task's vectors fit NATS messages (``EmbeddingsComputed``).
"""

from __future__ import annotations

import base64

import numpy as np
import numpy.typing as npt

Vectors = npt.NDArray[np.float32]  # shape (n, dimensions)
_FLOAT32_LE = np.dtype("<f4")


def encode_vectors(vectors: Vectors) -> str:
    """Rows of ``vectors`` as base64 of float32 little-endian."""
    return base64.b64encode(np.ascontiguousarray(vectors, dtype=_FLOAT32_LE).tobytes()).decode()


def decode_vectors(text: str, dimensions: int) -> Vectors:
    """What ``encode_vectors`` made, as rows of ``dimensions`` floats; ValueError if the text
    is no whole number of such rows."""
    raw = base64.b64decode(text, validate=True)
    if dimensions < 1 or len(raw) % (4 * dimensions):
        raise ValueError(f"{len(raw)} bytes are not whole vectors of {dimensions} float32")
    return np.frombuffer(raw, dtype=_FLOAT32_LE).reshape(-1, dimensions).astype(np.float32)


def rows_per_message(dimensions: int, budget_bytes: int = 384 * 1024) -> int:
    """How many vectors of ``dimensions`` one event carries: their base64 (4/3 of their bytes)
    within ``budget_bytes``, so that an event stays far below NATS's 1 MiB; at least one."""
    return max(1, budget_bytes * 3 // 4 // (4 * dimensions))
