"""What a runner answers about its model's tokenizer: a chat's tokens are exactly the prompt
a task of it is given when served (``prepare``, after its parts went through the log), on the
real SmolLM2; pieces, counts, BOS and refusals."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import pytest
from nats.js import JetStreamContext

from bus.stores.claim_check import checked_in, resolved
from bus.stores.parts import PartStore
from events.catalogue import TaskCreated
from events.records import ChatMessage, ResponseFormat, Tool, ToolChoice
from events.tokenizer import DescribeTokenizer, Detokenize, TokenizeChat, TokenizeText, TokenPiece
from harness.models.templated import SMOLLM2
from inference.engines.base import Engine
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.job import prepare
from services.runner.tokenizer_answers import answer, piece_of
from structured.reply import InvalidRequest

WEATHER = Tool(
    name="get_weather",
    description="The current weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def chat(**fields: Any) -> TaskCreated:
    return TaskCreated(
        task_id="t",
        model_id="m",
        origin="test",
        messages=[
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content="What is the weather in Paris?"),
        ],
        **fields,
    )


@pytest.fixture(scope="module")
def smollm2() -> LlamaCppEngine:
    engine = LlamaCppEngine(SMOLLM2, n_ctx=512, n_threads=1)
    engine.load()
    return engine


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"tools": [WEATHER]},
        {"tools": [WEATHER], "tool_choice": ToolChoice(mode="required")},
        {"response_format": ResponseFormat(type="json_object")},
        {"thinking": False, "chat_template_kwargs": {"custom": "x"}},
    ],
)
async def test_a_chats_tokens_are_its_tasks_prompt(
    smollm2: LlamaCppEngine, js: JetStreamContext, fields: Any
) -> None:
    """The prompt a runner gives a task it was served: its messages and tools stored as parts
    and read back (where a tool's schema gets its keys sorted)."""
    task = chat(**fields)
    served = await resolved(PartStore(js), await checked_in(PartStore(js), task))
    counted = answer(smollm2, TokenizeChat(task=task))
    assert counted.refused is None
    assert counted.tokens == prepare(smollm2, served).prompt
    assert counted.count == len(counted.tokens) and counted.n_ctx == 512
    only = answer(smollm2, TokenizeChat(task=task, count_only=True))
    assert only.count == counted.count and only.tokens == []


def test_tools_are_counted_as_the_model_reads_them(smollm2: LlamaCppEngine) -> None:
    plain = answer(smollm2, TokenizeChat(task=chat(), count_only=True)).count
    with_tools = answer(smollm2, TokenizeChat(task=chat(tools=[WEATHER]), count_only=True)).count
    assert with_tools > plain


def test_a_text_with_its_pieces(smollm2: LlamaCppEngine) -> None:
    text = "Hello world, café"
    got = answer(smollm2, TokenizeText(text=text, with_pieces=True))
    assert got.tokens == smollm2.tokenize(text, add_special=False, parse_special=True)
    assert got.pieces is not None and got.vocabulary is not None
    assert "".join(p.piece for p in got.pieces if isinstance(p.piece, str)) == text
    assert got.vocabulary[1] == "Ġworld"
    assert answer(smollm2, Detokenize(tokens=got.tokens)).text == text


def test_the_settings_and_refusals(smollm2: LlamaCppEngine) -> None:
    info = answer(smollm2, DescribeTokenizer()).info
    assert info is not None and info["eos_token"] == "<|im_end|>"
    refused = answer(smollm2, Detokenize(tokens=[10**9]))
    assert refused.refused == "invalid_request" and refused.error and "outside" in refused.error
    named = TaskCreated(
        task_id="t",
        model_id="m",
        origin="test",
        messages=[ChatMessage(role="user", content="hi")],
        tool_choice=ToolChoice(mode="function", name="nowhere"),
        tools=[WEATHER],
    )
    assert answer(smollm2, TokenizeChat(task=named)).refused == "invalid_request"


def test_a_piece_is_its_text_or_its_bytes() -> None:
    assert piece_of(b" world") == " world"
    assert piece_of("é".encode()[:1]) == [0xC3]
    assert TokenPiece(id=1, piece=piece_of(b"\xa9")).piece == [0xA9]


class _WithBos:
    """A tokenizer that puts a BOS (1) in front of text, and a template that writes none."""

    n_ctx = 64
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return ([1] if add_special else []) + [ord(c) for c in text]

    def chat_tokens(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        if not add_generation_prompt:
            raise InvalidRequest("always prompted")
        return [ord(c) for m in messages for c in m["content"]]


def test_add_special_puts_the_bos_in_front_of_a_chat_once() -> None:
    engine = cast(Engine, _WithBos())
    task = TaskCreated(
        task_id="t", model_id="m", origin="test", messages=[ChatMessage(role="user", content="ab")]
    )
    assert answer(engine, TokenizeChat(task=task)).tokens == [97, 98]
    assert answer(engine, TokenizeChat(task=task, add_special=True)).tokens == [1, 97, 98]
    bare = answer(engine, TokenizeChat(task=task, add_generation_prompt=False))
    assert bare.refused == "invalid_request" and bare.error == "always prompted"
