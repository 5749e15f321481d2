"""The MLX engine in-process, on tiny random-weight models."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from events.catalogue import TaskCreated
from events.records import ChatMessage, SamplingParams
from harness.models.tiny_mlx import CHATML
from inference.decoding import Decoding, PromptCached, Token
from inference.engines.mlx.engine import PREFILL_STEP, MlxEngine, prefill_chunks
from structured.reply import InvalidRequest
from tests.inference.engines.pipeline_head import prompt_of, run_task


@pytest.fixture(scope="module")
def engine(tiny_mlx: Path) -> MlxEngine:
    engine = MlxEngine(tiny_mlx, n_ctx=1024)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def tied(tiny_mlx_tied: Path) -> MlxEngine:
    engine = MlxEngine(tiny_mlx_tied, n_ctx=512)
    engine.load()
    return engine


def chat(text: str, **params: object) -> TaskCreated:
    return TaskCreated(
        task_id="t",
        model_id="m",
        origin="test",
        messages=[ChatMessage(role="user", content=text)],
        params=SamplingParams.model_validate(params),
    )


def completion(prompt: str | None, **params: object) -> TaskCreated:
    return TaskCreated(
        task_id="t",
        model_id="m",
        origin="test",
        kind="completion",
        prompt=prompt,
        params=SamplingParams.model_validate(params),
    )


def ids(items: object) -> list[int]:
    """The tokens' ids (a prompt cached in part says so first)."""
    assert isinstance(items, list)
    given = [t for t in items if not isinstance(t, PromptCached)]
    assert all(isinstance(t, Token) for t in given)
    return [t.id for t in given]


def uncached(generation: Iterator[object]) -> Iterator[object]:
    """A generation's items but the count of its prompt's tokens that were cached."""
    return (t for t in generation if not isinstance(t, PromptCached))


def first(engine: MlxEngine, prompt: list[int], n: int, **params: object) -> list[int]:
    decoding = Decoding(SamplingParams.model_validate(params))
    return ids(list(islice(uncached(engine.generate(prompt, decoding)), n)))


def mlx_lm_greedy(engine: MlxEngine, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(
        mx.array(prompt), engine.model, max_tokens=n, prefill_step_size=PREFILL_STEP
    )
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("model", ["engine", "tied"])
def test_greedy_is_mlx_lms_greedy_token_for_token(
    model: str, request: pytest.FixtureRequest
) -> None:
    engine: MlxEngine = request.getfixturevalue(model)
    for task in [chat("What is the capital city of France?"), completion("Once upon a time")]:
        prompt = prompt_of(engine, task)
        assert first(engine, prompt, 48, temperature=0) == mlx_lm_greedy(engine, prompt, 48)


def test_a_long_prompt_is_processed_in_chunks(engine: MlxEngine) -> None:
    prompt = (prompt_of(engine, completion("the sea is blue, " * 80)) * 2)[: PREFILL_STEP + 40]
    assert [len(c) for c in prefill_chunks(prompt)] == [PREFILL_STEP, 39, 1]
    assert first(engine, prompt, 8, temperature=0) == mlx_lm_greedy(engine, prompt, 8)


def test_chat_goes_through_the_template(engine: MlxEngine) -> None:
    tokens = prompt_of(engine, chat("Hi"))
    text = b"".join(engine.text.piece(t) for t in tokens)
    # Special tokens have no text of their own; the template's structure is around them.
    assert text == b"user\nHi\nassistant\n"
    tokenizer = engine.text._tokenizer
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokens == tokenizer.encode(expected, add_special_tokens=False)
    assert tokens[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_a_completion_is_the_plain_prompt(engine: MlxEngine) -> None:
    tokens = prompt_of(engine, completion("hello world"))
    assert b"".join(engine.piece(t) for t in tokens) == b"hello world"


def test_tools_reach_the_template(engine: MlxEngine) -> None:
    assert engine.chat_template == CHATML
    tok = engine.text._tokenizer
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    tok.chat_template = template
    try:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
        tokens = engine.chat_tokens([{"role": "user", "content": "Hi"}], tools)
        assert b"".join(engine.piece(t) for t in tokens) == b"[get_weather]Hi"
        assert engine.chat_template == template
    finally:
        tok.chat_template = CHATML


def test_requests_it_cannot_serve(engine: MlxEngine, tiny_mlx: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        engine.text_tokens("")
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate([], Decoding(SamplingParams()))
    with pytest.raises(InvalidRequest, match="context"):
        engine.generate([5] * engine.n_ctx, Decoding(SamplingParams()))
    with pytest.raises(InvalidRequest, match="logit_bias names token 400"):
        engine.generate([5], Decoding(SamplingParams(logit_bias={400: 1.0})))
    # A model without a chat template serves plain prompts only.
    plain = tmp_path / "plain"
    shutil.copytree(tiny_mlx, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    no_template = MlxEngine(plain)
    no_template.load()
    with pytest.raises(InvalidRequest, match="no chat template"):
        prompt_of(no_template, chat("Hi"))
    assert no_template.chat_template is None
    assert prompt_of(no_template, completion("hi")) == prompt_of(engine, completion("hi"))


def test_end_tokens_are_the_configs_and_the_tokenizers(engine: MlxEngine) -> None:
    tokenizer = engine.text._tokenizer
    endoftext, im_end, im_start = tokenizer.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
    )
    assert engine.is_end(endoftext) and engine.is_end(im_end)
    assert not engine.is_end(im_start)
    assert [t for t in range(len(tokenizer)) if engine.is_end(t)] == sorted([endoftext, im_end])


def test_pieces_are_the_tokens_bytes(engine: MlxEngine) -> None:
    text = "Café, naïve façade: 日本語のテキスト 🙂🚀 hello world"
    tokens = engine.text._tokenizer.encode(text, add_special_tokens=False)
    pieces = [engine.piece(t) for t in tokens]
    assert b"".join(pieces) == text.encode()

    def valid(piece: bytes) -> bool:
        try:
            piece.decode()
        except UnicodeDecodeError:
            return False
        return True

    # Byte-level BPE splits characters: these pieces are not UTF-8 on their own.
    assert any(not valid(p) for p in pieces)
    # Out of range ids have no text rather than an error.
    assert engine.piece(10**6) == b""


def test_the_served_text_is_the_decoded_tokens(engine: MlxEngine) -> None:
    out = run_task(engine, chat("Tell me about the sea.", temperature=0, max_tokens=40))
    assert out["finish"] in ("length", "stop") and out["tokens"]
    assert out["text"] == engine.text._tokenizer.decode(out["tokens"], skip_special_tokens=True)


def test_generation_stops_where_the_consumer_stops(engine: MlxEngine) -> None:
    prompt = prompt_of(engine, chat("What is the capital city of France?"))
    full = first(engine, prompt, 30, temperature=0)
    cancelled = run_task(
        engine,
        chat("What is the capital city of France?", temperature=0, max_tokens=30),
        cancel_after=5,
    )
    assert cancelled["finish"] == "cancelled" and cancelled["tokens"] == full[:5]
    # An abandoned generation leaves nothing behind.
    abandoned = engine.generate(prompt, Decoding(SamplingParams(temperature=0)))
    assert ids(list(islice(uncached(abandoned), 3))) == full[:3]
    assert first(engine, prompt, 30, temperature=0) == full
    # And each generation has its own cache.
    assert ids(list(islice(uncached(abandoned), 3))) == full[3:6]


def test_generation_ends_at_the_context(tiny_mlx: Path) -> None:
    engine = MlxEngine(tiny_mlx, n_ctx=24)
    engine.load()
    prompt = prompt_of(engine, chat("What is the capital city of France?"))
    assert len(prompt) == 21
    assert len(list(engine.generate(prompt, Decoding(SamplingParams(temperature=0))))) == 3
    # The model's trained context caps the requested one.
    assert MlxEngine(tiny_mlx, n_ctx=4096).n_ctx == 4096
    big = MlxEngine(tiny_mlx, n_ctx=4096)
    big.load()
    assert big.n_ctx == 1024


def test_sampling_follows_temperature_top_p_and_seed(engine: MlxEngine) -> None:
    prompt = prompt_of(engine, completion("Once upon a time"))
    greedy = first(engine, prompt, 16, temperature=0)
    # The logits are spread (standard deviation 8): raise the temperature to see choices.
    hot = {"temperature": 2.0, "max_tokens": 16}
    assert first(engine, prompt, 16, seed=3, **hot) == first(engine, prompt, 16, seed=3, **hot)
    runs = {tuple(first(engine, prompt, 16, seed=s, **hot)) for s in range(4)}
    assert len(runs) == 4 and tuple(greedy) not in runs
    # A nucleus this small holds only the most likely token: greedy again.
    assert first(engine, prompt, 16, seed=3, top_p=1e-6, **hot) == greedy


def test_penalties_change_the_output(engine: MlxEngine) -> None:
    prompt = prompt_of(engine, completion("hello hello hello hello"))
    greedy = first(engine, prompt, 48, temperature=0)
    penalised = first(
        engine, prompt, 48, temperature=0, presence_penalty=2.0, frequency_penalty=2.0
    )
    assert penalised != greedy
    assert len(set(penalised)) > len(set(greedy))


def test_loaded_in_one_thread_served_in_another(tiny_mlx: Path, engine: MlxEngine) -> None:
    """The runner loads with asyncio.to_thread and generates in its event loop's thread; mlx's
    streams are per thread."""
    other = MlxEngine(tiny_mlx, n_ctx=512)
    loader = threading.Thread(target=other.load)
    loader.start()
    loader.join()
    prompt = prompt_of(engine, chat("Hi"))
    assert first(other, prompt, 10, temperature=0) == first(engine, prompt, 10, temperature=0)
