"""Anthropic's own `anthropic` SDK, unchanged, against one `shoal up` (SmolLM2, llama.cpp):
messages whole and streamed (``text_stream``, ``get_final_message()``), a tool-use round trip,
stop sequences, token counts, the SDK's own error classes, an alias, a second API process.

SmolLM2-135M knows nothing of tools: what these tests check is what the grammar guarantees (a
call of an offered tool, with input that validates), not how clever a 135M model is. The SDK
no longer sends sampling parameters of its own: ``temperature`` goes in ``extra_body``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from anthropic.types import (
    Message,
    MessageParam,
    TextBlock,
    ToolChoiceParam,
    ToolParam,
    ToolUseBlock,
)

import tests.api.asks as asks
from tests.api.up_cluster import UpCluster

pytestmark = pytest.mark.slow

WEATHER: ToolParam = {
    "name": asks.WEATHER_NAME,
    "description": asks.WEATHER_DESCRIPTION,
    "input_schema": asks.WEATHER_PARAMETERS,
}
ASK: list[MessageParam] = [{"role": "user", "content": asks.WEATHER_QUESTION}]
HELLO: list[MessageParam] = [{"role": "user", "content": asks.HELLO}]
GREEDY = {"temperature": 0}


@pytest.fixture
def client(up_cluster: UpCluster) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=up_cluster.base, api_key=up_cluster.key, max_retries=0
    ) as made:
        yield made


def _text(message: Message) -> str:
    blocks = [b for b in message.content if isinstance(b, TextBlock)]
    assert len(blocks) <= 1, message.content
    return blocks[0].text if blocks else ""


def _tool_uses(message: Message) -> list[ToolUseBlock]:
    return [b for b in message.content if isinstance(b, ToolUseBlock)]


def _weather_input(block: ToolUseBlock) -> dict[str, Any]:
    """What the grammar guarantees: the schema's keys, a string city, a unit of the enum."""
    assert block.name == "get_weather" and block.id
    given = block.input
    assert isinstance(given, dict) and set(given) == {"city", "unit"}, given
    assert isinstance(given["city"], str) and given["unit"] in ("celsius", "fahrenheit")
    return given


def test_create_a_message(client: anthropic.Anthropic, up_cluster: UpCluster) -> None:
    made = client.messages.create(
        model=up_cluster.model,
        max_tokens=24,
        messages=HELLO,
        system="You are friendly.",
        extra_body=GREEDY,
    )
    assert made.id.startswith("msg_") and made.type == "message" and made.role == "assistant"
    assert made.model == up_cluster.model
    assert [b.type for b in made.content] == ["text"] and _text(made).strip()
    assert made.stop_reason in ("end_turn", "max_tokens") and made.stop_sequence is None
    assert made.usage.input_tokens > 0 and 0 < made.usage.output_tokens <= 24
    assert made.usage.cache_read_input_tokens is not None


def test_a_stream_and_its_final_message(client: anthropic.Anthropic, up_cluster: UpCluster) -> None:
    with client.messages.stream(
        model=up_cluster.model, max_tokens=24, messages=HELLO, extra_body=GREEDY
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces).strip()
    assert _text(final) == "".join(pieces)
    assert final.stop_reason in ("end_turn", "max_tokens") and final.model == up_cluster.model
    assert final.usage.input_tokens > 0 and 0 < final.usage.output_tokens <= 24


def test_message_start_says_the_prompts_tokens(
    client: anthropic.Anthropic, up_cluster: UpCluster
) -> None:
    # As Anthropic's does, and Claude Code's context accounting reads: the stream starts with
    # the first token, when the prompt's size is known (issue 35).
    for system in ("You are terse.", "You are friendly and you answer in one short line."):
        with client.messages.stream(
            model=up_cluster.model, max_tokens=8, system=system, messages=HELLO, extra_body=GREEDY
        ) as stream:
            events = list(stream)
            final = stream.get_final_message()
        starts = [e for e in events if e.type == "message_start"]
        assert len(starts) == 1 and events[0] is starts[0]
        said = starts[0].message.usage
        assert said.input_tokens == final.usage.input_tokens > 0
        assert said.cache_read_input_tokens == final.usage.cache_read_input_tokens
        assert said.output_tokens == 0


def test_a_tool_use_round_trip(client: anthropic.Anthropic, up_cluster: UpCluster) -> None:
    any_one: ToolChoiceParam = {"type": "any", "disable_parallel_tool_use": True}
    first = client.messages.create(
        model=up_cluster.model,
        max_tokens=80,
        messages=ASK,
        tools=[WEATHER],
        tool_choice=any_one,
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    [call] = _tool_uses(first)
    assert all(b.type == "tool_use" for b in first.content)  # no empty text block
    _weather_input(call)

    with client.messages.stream(
        model=up_cluster.model,
        max_tokens=80,
        messages=ASK,
        tools=[WEATHER],
        tool_choice=any_one,
        extra_body=GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    [streamed_call] = _tool_uses(streamed)
    _weather_input(streamed_call)

    history: list[MessageParam] = [
        *ASK,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 degrees."}
            ],
        },
    ]
    answer = client.messages.create(
        model=up_cluster.model,
        max_tokens=40,
        messages=history,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert not _tool_uses(answer) and _text(answer).strip()
    assert answer.stop_reason in ("end_turn", "max_tokens")
    auto = client.messages.create(
        model=up_cluster.model, max_tokens=60, messages=history, tools=[WEATHER], extra_body=GREEDY
    )
    if auto.stop_reason == "tool_use":
        for block in _tool_uses(auto):
            _weather_input(block)
    else:
        assert not _tool_uses(auto) and '"response"' not in _text(auto)


def test_parallel_tool_uses_end_at_the_first_repeat(
    client: anthropic.Anthropic, up_cluster: UpCluster
) -> None:
    # Allowed several calls, this model writes the same one until max_tokens: the first repeat
    # ends the message, with stop_reason tool_use, and is not in it.
    made = client.messages.create(
        model=up_cluster.model,
        max_tokens=200,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    inputs = [_weather_input(block) for block in _tool_uses(made)]
    assert made.stop_reason == "tool_use" and inputs
    assert all(given not in inputs[:i] for i, given in enumerate(inputs)), inputs
    assert made.usage.output_tokens < 200


def test_stop_sequences(client: anthropic.Anthropic, up_cluster: UpCluster) -> None:
    # Any reply of two words has a space: the reply ends before its first one.
    made = client.messages.create(
        model=up_cluster.model,
        max_tokens=40,
        messages=HELLO,
        stop_sequences=["zzqqzz", " "],
        extra_body=GREEDY,
    )
    assert made.stop_reason == "stop_sequence" and made.stop_sequence == " "
    assert " " not in _text(made)
    with client.messages.stream(
        model=up_cluster.model,
        max_tokens=40,
        messages=HELLO,
        stop_sequences=[" "],
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == " "


def test_count_tokens(client: anthropic.Anthropic, up_cluster: UpCluster) -> None:
    def count(**fields: Any) -> int:
        fields.setdefault("messages", HELLO)
        return client.messages.count_tokens(model=up_cluster.model, **fields).input_tokens

    plain = count()
    assert plain > 0
    longer: list[MessageParam] = [
        {
            "role": "user",
            "content": "Say hello in one short sentence, and then another one about the weather.",
        }
    ]
    assert count(messages=longer) > plain
    # (SmolLM2's template has a system prompt of its own for a chat that sends none.)
    short = count(system="You are brief.")
    assert count(system="You are brief, and you answer in the language of the question.") > short
    assert count(tools=[WEATHER]) > plain  # the tools are part of what the model reads
    # The count is the prompt of a create with the same conversation (of which Anthropic's
    # usage counts what the cache held apart).
    made = client.messages.create(model=up_cluster.model, max_tokens=1, messages=HELLO)
    assert made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0) == plain


def test_errors_are_the_sdks_own(client: anthropic.Anthropic, up_cluster: UpCluster) -> None:
    bad = anthropic.Anthropic(base_url=up_cluster.base, api_key="wrong", max_retries=0)
    with bad, pytest.raises(anthropic.AuthenticationError) as auth:
        bad.messages.create(model=up_cluster.model, max_tokens=8, messages=HELLO)
    assert auth.value.status_code == 401 and "wrong" not in str(auth.value)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=8, messages=HELLO)
    assert "no-such-model" in str(missing.value)
    with pytest.raises(anthropic.BadRequestError) as no_max:
        client.post(
            "/v1/messages", cast_to=Message, body={"model": up_cluster.model, "messages": HELLO}
        )
    assert "max_tokens" in str(no_max.value)
    image: list[MessageParam] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                },
            ],
        }
    ]
    with pytest.raises(anthropic.BadRequestError) as unreadable:
        client.messages.create(model=up_cluster.model, max_tokens=8, messages=image)
    assert "image" in str(unreadable.value)
    with pytest.raises(anthropic.BadRequestError) as thinking:
        client.messages.create(
            model=up_cluster.model,
            max_tokens=2048,
            messages=HELLO,
            thinking={"type": "between_tools"},
        )
    assert "thinking" in str(thinking.value)


def test_an_alias_and_the_model_list(client: anthropic.Anthropic, up_cluster: UpCluster) -> None:
    made = client.messages.create(model=up_cluster.alias, max_tokens=8, messages=HELLO)
    assert made.model == up_cluster.alias and _text(made)
    listed = client.models.list()
    ids = [m.id for m in listed.data]
    assert {up_cluster.model, up_cluster.alias} <= set(ids)
    assert all(m.type == "model" and m.display_name for m in listed.data)


def test_a_second_api_process_serves_too(up_cluster: UpCluster) -> None:
    with anthropic.Anthropic(
        base_url=up_cluster.second, api_key=up_cluster.key, max_retries=0
    ) as other:
        made = other.messages.create(model=up_cluster.model, max_tokens=8, messages=HELLO)
    assert made.type == "message" and _text(made)
