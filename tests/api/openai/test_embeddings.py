"""OpenAI's embeddings request and response, as pure translation (api/openai/embeddings.py), and the
vectors' wire format (events/vectors.py)."""

from __future__ import annotations

import base64
import struct

import numpy as np
import pytest
from pydantic import ValidationError

from api.openai.embeddings import MAX_INPUTS, EmbeddingsRequest, embeddings_response, floats_of_b64
from events.vectors import decode_vectors, encode_vectors, rows_per_message


def request(**fields: object) -> EmbeddingsRequest:
    return EmbeddingsRequest.model_validate({"model": "m", **fields})


@pytest.mark.parametrize(
    ("sent", "inputs"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),  # one input, as token ids
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_every_form_of_input(sent: object, inputs: list[object]) -> None:
    assert request(input=sent).inputs() == inputs


@pytest.mark.parametrize(
    ("sent", "message"),
    [
        ("", "empty string"),
        ([], "empty list"),
        (["a", ""], "input 1 is empty"),
        ([[1], []], "input 1 is empty"),
        ([1, -2], "not negative"),
        ([[1], [-2]], "input 1: token ids are not negative"),
        (["x"] * (MAX_INPUTS + 1), f"at most {MAX_INPUTS}"),
        (["a", 1], "input"),
        ({"text": "a"}, "input"),
    ],
)
def test_inputs_that_are_refused(sent: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        request(input=sent)


def test_the_other_fields() -> None:
    body = request(input="x", encoding_format="base64", dimensions=64, user="u-1")
    assert (body.encoding_format, body.dimensions, body.user) == ("base64", 64, "u-1")
    assert EmbeddingsRequest.model_validate({"input": "x"}).model is None  # the default model
    for bad in ({"encoding_format": "int8"}, {"dimensions": 0}, {"user": "u" * 256}):
        with pytest.raises(ValidationError):
            request(input="x", **bad)


def test_the_response_in_openai_s_shape() -> None:
    v = np.array([[0.6, 0.8], [1.0, 0.0]], dtype=np.float32)
    body = embeddings_response("my-model", v, 7)
    assert body == {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": 0,
                "embedding": [pytest.approx(0.6), pytest.approx(0.8)],
            },
            {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]},
        ],
        "model": "my-model",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }


def test_base64_is_the_float32_values_little_endian() -> None:
    v = np.array([[0.6, -0.8], [0.25, 0.5]], dtype=np.float32)
    body = embeddings_response("m", v, 3, "base64")
    first = body["data"][0]["embedding"]
    assert base64.b64decode(first) == struct.pack("<2f", 0.6, -0.8)
    # What the float answer holds, the base64 one holds too.
    floats = embeddings_response("m", v, 3)["data"]
    for entry, as_float in zip(body["data"], floats, strict=True):
        assert floats_of_b64(entry["embedding"]) == as_float["embedding"]


def test_vectors_on_the_wire() -> None:
    v = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    text = encode_vectors(v)
    assert np.array_equal(decode_vectors(text, 7), v)
    assert base64.b64decode(text) == v.astype("<f4").tobytes()
    with pytest.raises(ValueError, match="not whole vectors of 6"):
        decode_vectors(text, 6)
    assert rows_per_message(576) == 128
    assert rows_per_message(10**7) == 1  # one vector however large
