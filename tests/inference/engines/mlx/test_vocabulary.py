"""An MLX model's tokenizer as clients ask it, beyond every engine's contract
(``contract/test_tokenizer.py``): literal encoding leaves other threads' prompts alone, the
settings are the tokenizer config's as vLLM gives them; on the tiny model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from harness.models.tiny_mlx import CHATML
from inference.engines.mlx.engine import MlxEngine

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


def test_the_settings_are_the_tokenizer_configs(
    engine: MlxEngine, reference: PreTrainedTokenizerBase
) -> None:
    info = engine.tokenizer_info()
    assert info["tokenizer_class"] == type(reference).__name__  # as vLLM names it
    assert info["added_tokens_decoder"]["1"] == "<|im_start|>"  # an AddedToken as its text
    assert info["eos_token"] == "<|im_end|>" and info["pad_token"] == "<|endoftext|>"
    assert info["model_max_length"] == 2048 and info["chat_template"] == CHATML
    assert "name_or_path" not in info and "tokenizer_file" not in info
