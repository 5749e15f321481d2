"""The model's tokenizer as clients ask it (``/tokenize``, ``/detokenize``), on every engine:
the ids are the model's own tokenizer's (llama.cpp's of the GGUF, Hugging Face's of the MLX
folder), detokenizing is their inverse, special tokens written in the text are tokens only
when parsed, a token outside the vocabulary is refused, a chat may be tokenized without its
generation prompt."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from llama_cpp import Llama
from transformers import AutoTokenizer

from inference.engines.base import Engine
from structured.reply import InvalidRequest
from tests.inference.engines.conftest import SMOLLM2_GGUF
from tests.inference.engines.contract.running import user

TEXTS = [
    "Hello world",
    " leading space, trailing space ",
    "Café, naïve, 日本語 🙂\n\ttabs",
    "<|im_start|>user\nHi<|im_end|>",
    "",
]
# The model's own tokenizer: a text, whether to add the special tokens, whether to read those
# written in the text.
Tokenize = Callable[[str, bool, bool], list[int]]


@pytest.fixture(scope="module")
def reference(engine_kind: str, request: pytest.FixtureRequest) -> Tokenize:
    if engine_kind == "llamacpp":
        llm = Llama(model_path=str(SMOLLM2_GGUF), vocab_only=True, verbose=False)
        return lambda text, add, parse: llm.tokenize(text.encode(), add_bos=add, special=parse)
    folder: Path = request.getfixturevalue("tiny_mlx")
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def hugging_face(text: str, add: bool, parse: bool) -> list[int]:
        assert parse  # Hugging Face's tokenizer reads them always
        return list(tokenizer.encode(text, add_special_tokens=add))

    return hugging_face


@pytest.mark.parametrize("text", TEXTS)
def test_the_ids_are_the_models_own(engine: Engine, reference: Tokenize, text: str) -> None:
    for add_special in (False, True):
        got = engine.tokenize(text, add_special=add_special, parse_special=True)
        assert got == reference(text, add_special, True)
    assert engine.detokenize(engine.tokenize(text, add_special=False, parse_special=True)) == text


def test_llama_cpps_ids_without_reading_special_tokens(
    engine: Engine, engine_kind: str, reference: Tokenize
) -> None:
    if engine_kind != "llamacpp":
        pytest.skip("Hugging Face's tokenizer reads special tokens always")
    for text in TEXTS:
        got = engine.tokenize(text, add_special=True, parse_special=False)
        assert got == reference(text, True, False)


def test_special_tokens_in_text_are_tokens_only_when_parsed(
    engine: Engine, reference: Tokenize
) -> None:
    text = "<|im_start|>user"
    parsed = engine.tokenize(text, add_special=False, parse_special=True)
    literal = engine.tokenize(text, add_special=False, parse_special=False)
    assert parsed[0] == reference("<|im_start|>", False, True)[0]
    assert engine.detokenize(parsed) == text
    assert len(literal) > len(parsed)
    assert engine.detokenize(literal) == text


def test_a_token_outside_the_vocabulary_is_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="outside"):
        engine.detokenize([1, engine.n_vocab])
    with pytest.raises(InvalidRequest):
        engine.detokenize([-1])
    assert engine.vocabulary_text(engine.n_vocab) == ""
    assert engine.vocabulary_text(10**6) == ""


def test_the_vocabulary_spells_bytes_as_gpt2_does(engine: Engine) -> None:
    [world] = engine.tokenize(" world", add_special=False, parse_special=True)
    assert engine.vocabulary_text(world) == "Ġworld"
    assert engine.spelled(world) == b" world"


def test_a_chat_without_the_generation_prompt(engine: Engine) -> None:
    prompted = engine.chat_tokens(user("What is 2 + 2?"), None)
    bare = engine.chat_tokens(user("What is 2 + 2?"), None, add_generation_prompt=False)
    assert prompted[: len(bare)] == bare and len(prompted) > len(bare)
    assert engine.detokenize(prompted[len(bare) :]) == "<|im_start|>assistant\n"
