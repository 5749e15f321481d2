"""OpenAI's embeddings request and response (``POST /v1/embeddings``), as pure translation.

``input`` is a string, a list of strings, a list of token ids (one input) or a list of such
lists; none may be empty. ``dimensions`` keeps that many leading dimensions of each vector and
normalises it again (what Matryoshka-trained models, nomic-embed-text v1.5 for one, are made
for; Shoal cuts any model's vectors so, up to its own size). ``encoding_format: "base64"``
sends each vector as base64 of its float32 values, little-endian, as OpenAI does.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from events.records import INT32_MAX
from events.vectors import Vectors, encode_vectors

# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048

Inputs = str | list[str] | list[int] | list[list[int]]


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    user: Annotated[str, Field(max_length=255)] | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: Inputs) -> Inputs:
        if isinstance(value, str):
            if not value:
                raise ValueError("the input is an empty string")
            return value
        if not value:
            raise ValueError("the input is an empty list: send at least one input")
        if isinstance(value[0], int):
            if any(isinstance(t, int) and t < 0 for t in value):
                raise ValueError("token ids are not negative")
            return value
        if len(value) > MAX_INPUTS:
            raise ValueError(f"{len(value)} inputs: at most {MAX_INPUTS} in one request")
        for i, item in enumerate(value):
            if not item:
                raise ValueError(f"input {i} is empty")
            if isinstance(item, list) and any(t < 0 for t in item):
                raise ValueError(f"input {i}: token ids are not negative")
        return value

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs, each a text or a list of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if isinstance(value[0], int):
            return [[t for t in value if isinstance(t, int)]]
        return value  # a list of texts or of token lists


def floats_of_b64(text: str) -> list[float]:
    """A base64 vector as floats (what a client does with it)."""
    return [float(x) for x in np.frombuffer(base64.b64decode(text), dtype="<f4")]


def embeddings_response(
    model: str, vectors: Vectors, prompt_tokens: int, encoding_format: str = "float"
) -> dict[str, Any]:
    """OpenAI's answer: one entry per input, in order, and the tokens read."""
    if encoding_format == "base64":
        # One vector's base64 is what the event carries for several: the same encoding.
        embeddings: list[Any] = [encode_vectors(v) for v in vectors]
    else:
        embeddings = vectors.tolist()
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
