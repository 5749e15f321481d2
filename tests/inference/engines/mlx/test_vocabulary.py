"""An MLX model's tokenizer as clients ask it (``/tokenize``, ``/detokenize``,
``/tokenizer_info``): Hugging Face's tokenizer's own ids and decoding, its settings as vLLM
gives them; on the tiny model (a byte-level BPE with ChatML's special tokens)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from harness.models.tiny_mlx import CHATML
from inference.engines.mlx.engine import MlxEngine
from structured.reply import InvalidRequest

TEXTS = ["Hello world", "Café, naïve 🙂\n", "<|im_start|>user\nhi<|im_end|>", ""]
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def engine(tiny_mlx: Path) -> MlxEngine:
    made = MlxEngine(tiny_mlx, n_ctx=512)
    made.load()
    return made


@pytest.fixture(scope="module")
def reference(tiny_mlx: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_mlx)


@pytest.mark.parametrize("text", TEXTS)
def test_the_ids_are_the_tokenizers_own(
    engine: MlxEngine, reference: PreTrainedTokenizerBase, text: str
) -> None:
    for add_special in (False, True):
        got = engine.tokenize(text, add_special=add_special, parse_special=True)
        assert got == reference.encode(text, add_special_tokens=add_special)
    assert engine.detokenize(engine.tokenize(text, add_special=False, parse_special=True)) == text


def test_special_tokens_in_text_may_be_read_as_text(engine: MlxEngine) -> None:
    text = "<|im_start|>user"
    parsed = engine.tokenize(text, add_special=False, parse_special=True)
    literal = engine.tokenize(text, add_special=False, parse_special=False)
    assert len(literal) > len(parsed)
    assert engine.detokenize(literal) == text
    # The shared tokenizer was not switched: a prompt made meanwhile still reads them.
    assert engine.tokenize(text, add_special=False, parse_special=True) == parsed


def test_literal_encoding_leaves_other_threads_prompts_alone(engine: MlxEngine) -> None:
    parsed = engine.tokenize("<|im_end|>", add_special=False, parse_special=True)
    seen: list[list[int]] = []

    def prompts() -> None:
        for _ in range(200):
            seen.append(engine.tokenize("<|im_end|>", add_special=False, parse_special=True))

    other = threading.Thread(target=prompts)
    other.start()
    for _ in range(200):
        engine.tokenize("<|im_end|>", add_special=False, parse_special=False)
    other.join()
    assert all(s == parsed for s in seen)


def test_a_token_outside_the_vocabulary_is_refused(engine: MlxEngine) -> None:
    with pytest.raises(InvalidRequest, match="outside"):
        engine.detokenize([0, 10**6])
    assert engine.vocabulary_text(10**6) == ""


def test_the_settings_are_the_tokenizer_configs(
    engine: MlxEngine, reference: PreTrainedTokenizerBase
) -> None:
    info = engine.tokenizer_info()
    assert info["tokenizer_class"] == type(reference).__name__  # as vLLM names it
    assert info["added_tokens_decoder"]["1"] == "<|im_start|>"  # an AddedToken as its text
    assert info["eos_token"] == "<|im_end|>" and info["pad_token"] == "<|endoftext|>"
    assert info["model_max_length"] == 2048 and info["chat_template"] == CHATML
    assert "name_or_path" not in info and "tokenizer_file" not in info


def test_a_chat_without_the_generation_prompt(engine: MlxEngine) -> None:
    prompted = engine.chat_tokens(USER, None)
    bare = engine.chat_tokens(USER, None, add_generation_prompt=False)
    assert prompted[: len(bare)] == bare
    assert engine.detokenize(prompted[len(bare) :]) == "<|im_start|>assistant\n"
