"""Anthropic's Messages API, data in and data out: request bodies to task fields (and what is
refused), replies to messages, chunks to named stream events."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

import pytest
from pydantic import ValidationError

from api.anthropic.messages import (
    MessagesBody,
    MessagesOut,
    MessagesRequest,
    model_list,
    task_for,
)
from api.anthropic.shapes import whole_message
from api.errors import ApiError
from api.reply import Reply
from events.catalogue import ChunkGenerated
from events.records import (
    ChatMessage,
    FinishReason,
    ResponseFormat,
    SamplingParams,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    Usage,
)

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def request(**fields: Any) -> MessagesRequest:
    base = {"model": "m", "max_tokens": 16, "messages": ASK}
    return MessagesRequest.model_validate(base | fields)


def refused(**fields: Any) -> str:
    with pytest.raises(ValidationError) as err:
        request(**fields)
    return str(err.value)


# --- requests -------------------------------------------------------------------------------


def test_system_and_content_blocks_become_chat_messages() -> None:
    hi = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]
    body = request(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[{"role": "user", "content": hi}],
    )
    assert body.chat_messages() == [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi!"),
    ]
    assert request(system="Short.").chat_messages()[0] == ChatMessage(
        role="system", content="Short."
    )


def test_a_tool_round_trip_becomes_calls_and_tool_messages() -> None:
    body = request(
        tools=[WEATHER],
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two calls.", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "call_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                    {
                        "type": "tool_use",
                        "id": "call_2",
                        "name": "get_weather",
                        "input": {"city": "Nice"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "Sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "no station"}],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    assert body.chat_messages()[1:] == [
        ChatMessage(
            role="assistant",
            content="Let me look.",
            reasoning="Two calls.",
            tool_calls=[
                ToolCall(id="call_1", name="get_weather", arguments=json.dumps({"city": "Paris"})),
                ToolCall(id="call_2", name="get_weather", arguments=json.dumps({"city": "Nice"})),
            ],
        ),
        ChatMessage(role="tool", content="Sunny", tool_call_id="call_1"),
        ChatMessage(role="tool", content="Error: no station", tool_call_id="call_2"),
        ChatMessage(role="user", content="And tomorrow?"),
    ]


def test_sampling_and_task_fields() -> None:
    body = request(
        temperature=0.2,
        top_p=0.9,
        top_k=40,
        stop_sequences=["\n\n", ""],
        metadata={"user_id": "u-1"},
    )
    params = body.sampling()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.stop) == (
        16,
        0.2,
        0.9,
        40,
        ["\n\n"],
    )
    task = task_for(body, "smollm2", "api@x", params)
    assert (task.model_id, task.kind, task.user, task.tools) == ("smollm2", "chat", "u-1", [])
    assert task.tool_choice == ToolChoice(mode="none") and task.response_format is None
    assert request().sampling().temperature == 1.0  # Anthropic's default


@pytest.mark.parametrize(
    ("choice", "mode", "parallel"),
    [
        (None, ToolChoice(mode="auto"), True),
        ({"type": "auto"}, ToolChoice(mode="auto"), True),
        ({"type": "any"}, ToolChoice(mode="required"), True),
        ({"type": "any", "disable_parallel_tool_use": True}, ToolChoice(mode="required"), False),
        (
            {"type": "tool", "name": "get_weather"},
            ToolChoice(mode="function", name="get_weather"),
            True,
        ),
        ({"type": "none"}, ToolChoice(mode="none"), True),
    ],
)
def test_tool_choices(choice: dict[str, Any] | None, mode: ToolChoice, parallel: bool) -> None:
    fields = request(tools=[WEATHER], tool_choice=choice).task_fields()
    assert fields["tool_choice"] == mode and fields["parallel_tool_calls"] is parallel
    assert [t.name for t in fields["tools"]] == ["get_weather"]
    assert fields["tools"][0].parameters == WEATHER["input_schema"]


def test_an_output_format_constrains_the_reply() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fields in (
        {"output_config": {"format": {"type": "json_schema", "schema": schema}}},
        {"output_format": {"type": "json_schema", "schema": schema}},
    ):
        assert request(**fields).task_fields()["response_format"] == ResponseFormat(
            type="json_schema", name="output", json_schema=schema
        )


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "file", "file_id": "file_1"},
                            }
                        ],
                    }
                ]
            },
            "content[0] an image source of type 'file' is not supported",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "document", "source": {"type": "text", "data": "x"}}],
                    }
                ]
            },
            "a document",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "c",
                                "content": [{"type": "image", "source": {}}],
                            }
                        ],
                    }
                ]
            },
            "content[0].content[0] an image block needs its source",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
                    }
                ]
            },
            "'tool_use' is not supported here",
        ),
        ({"messages": [*ASK, {"role": "assistant", "content": "The weather is"}]}, "prefill"),
        ({"thinking": {"type": "between_tools"}}, "thinking of type 'between_tools'"),
        (
            {
                "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
                "tool_choice": {"type": "tool", "name": "web_search"},
            },
            "the server tool 'web_search': Shoal runs no server tools",
        ),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "its schema is Anthropic's"),
        (
            {
                "tools": [
                    WEATHER
                    | {
                        "input_schema": {
                            "type": "object",
                            "properties": {"n": {"$ref": "#/$defs/N"}},
                        }
                    }
                ]
            },
            "the JSON schema $ref '#/$defs/N' (at properties.n) points to nothing",
        ),
        (
            {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
            "the context edit 'clear_tool_uses_20250919' is not supported",
        ),
        ({"tools": [WEATHER, WEATHER]}, "same name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "'other'"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"container": "c-1"}, "container"),
        ({"output_config": {"effort": "extreme"}}, "effort"),
        ({"temperature": 1.5}, "temperature"),
        ({"system": [{"type": "image", "source": {}}]}, "system[0] a block of type 'image'"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_it(fields: dict[str, Any], says: str) -> None:
    assert says in refused(**fields)


def test_max_tokens_is_required_but_not_to_count() -> None:
    with pytest.raises(ValidationError, match="max_tokens"):
        MessagesRequest.model_validate({"model": "m", "messages": ASK})
    body = MessagesBody.model_validate({"model": "m", "messages": ASK, "tools": [WEATHER]})
    task = task_for(body, "m", "api", SamplingParams())
    assert task.tools[0].name == "get_weather"
    assert task.tool_choice == ToolChoice(mode="auto")  # the tools as the model sees them


def test_fields_that_do_not_change_the_answer_are_accepted() -> None:
    body = request(
        thinking={"type": "disabled"},
        service_tier="auto",
        cache_control={"type": "ephemeral"},
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
    )
    assert body.chat_messages() == [ChatMessage(role="user", content="Hi")]


# --- responses ------------------------------------------------------------------------------

Call = tuple[str, str, str]  # id, name, arguments


def reply(
    text: str = "",
    calls: Sequence[Call] = (),
    finish: FinishReason = "stop",
    stop: str | None = None,
) -> Reply:
    r = Reply()
    for i, chunk in enumerate(chunks(text, calls, finish, stop)):
        assert chunk.idx == i
        r.add(chunk)
    return r


def chunks(
    text: str, calls: Sequence[Call], finish: FinishReason, stop: str | None = None
) -> list[ChunkGenerated]:
    """The text a word a chunk, then each call: its id and name, then its arguments in two.
    The first says the prompt's size, as a runner's does."""
    out = [ChunkGenerated(task_id="t", idx=0, text="", origin="r", prompt_tokens=12)]
    for word in text.split(" ") if text else []:
        piece = word if len(out) == 1 else f" {word}"
        out.append(ChunkGenerated(task_id="t", idx=len(out), text=piece, origin="r"))
    for i, (call_id, name, args) in enumerate(calls):
        half = len(args) // 2
        for delta in (
            ToolCallDelta(index=i, id=call_id, name=name, arguments=args[:half]),
            ToolCallDelta(index=i, arguments=args[half:]),
        ):
            out.append(
                ChunkGenerated(task_id="t", idx=len(out), text="", origin="r", tool_calls=(delta,))
            )
    out.append(
        ChunkGenerated(
            task_id="t", idx=len(out), text="", origin="r", finish_reason=finish, stop_sequence=stop
        )
    )
    return out


USAGE = Usage(prompt_tokens=12, completion_tokens=5)


def test_a_whole_message() -> None:
    made = whole_message("msg_1", "claude-x", reply("Hello there"), USAGE)
    assert made == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [{"type": "text", "text": "Hello there"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "output_tokens": 5,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
    assert whole_message("m", "x", reply(""), USAGE)["content"] == [{"type": "text", "text": ""}]
    # A prompt's cached part is counted apart from its input tokens, as Anthropic does.
    cached = Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=10)
    assert whole_message("m", "x", reply("Hi"), cached)["usage"] == {
        "input_tokens": 2,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 10,
    }


@pytest.mark.parametrize(
    ("r", "reason", "sequence"),
    [
        (reply("a", finish="length"), "max_tokens", None),
        (reply("a", stop="\n\n"), "stop_sequence", "\n\n"),
        (reply("a", finish="cancelled"), "end_turn", None),
        (reply(calls=[("call_1", "f", "{}")], finish="tool_calls"), "tool_use", None),
    ],
)
def test_stop_reasons(r: Reply, reason: str, sequence: str | None) -> None:
    made = whole_message("m", "x", r, USAGE)
    assert (made["stop_reason"], made["stop_sequence"]) == (reason, sequence)


def test_tool_use_blocks_have_parsed_input_and_no_empty_text_block() -> None:
    calls = [("call_1", "get_weather", '{"city": "Paris"}'), ("call_2", "f", "")]
    made = whole_message("m", "x", reply("", calls, "tool_calls"), USAGE)
    assert made["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "f", "input": {}},
    ]
    with_text = whole_message("m", "x", reply("Looking", calls[:1], "tool_calls"), USAGE)
    assert [b["type"] for b in with_text["content"]] == ["text", "tool_use"]
    cut = whole_message("m", "x", reply("", [("c", "f", '{"city": "Pa')], "length"), USAGE)
    assert cut["content"][0]["input"] == {} and cut["stop_reason"] == "max_tokens"


# --- streams --------------------------------------------------------------------------------

Events = list[tuple[str, dict[str, Any]]]  # (name, data) each


def parse(stream: str) -> Events:
    """(event name, data) of each server-sent event; the name is the data's type."""
    events = []
    for raw in stream.split("\n\n"):
        if not raw:
            continue
        name_line, data_line = raw.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert name == data["type"]
        events.append((name, data))
    return events


def streamed(
    text: str, calls: Sequence[Call], finish: FinishReason, stop: str | None = None
) -> tuple[Events, Reply]:
    out = MessagesOut("msg_1", "claude-x")
    made = chunks(text, calls, finish, stop)
    r = Reply()
    for c in made:
        r.add(c)
    # The first group comes with the opening, as api/serving.py sends them.
    stream = out.opening(None, 0) + out.events(0, made[:2])  # type: ignore[arg-type]
    stream += "".join(out.events(0, [c]) for c in made[2:])
    return parse(stream + out.closing([r], [USAGE])), r


def accumulate(events: Events) -> dict[str, Any]:
    """The message a client builds from the events, as Anthropic's SDK does."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for name, data in events:
        if name == "message_start":
            message = copy.deepcopy(data["message"])
        elif name == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        elif name == "content_block_stop" and data["index"] in partial:
            message["content"][data["index"]]["input"] = json.loads(partial[data["index"]])
        elif name == "message_delta":
            message |= data["delta"]
            message["usage"] |= data["usage"]
    return message


def test_a_streamed_text_message() -> None:
    events, r = streamed("Hello there friend", [], "stop", "\n")
    names = [n for n, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == "claude-x"
    assert start["usage"]["input_tokens"] == 12  # as the first chunk said
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n"}
    assert final["usage"]["input_tokens"] == 12 and final["usage"]["output_tokens"] == 5
    assert accumulate(events) == whole_message("msg_1", "claude-x", r, USAGE)


def test_message_start_says_the_prompts_size_from_the_first_chunk() -> None:
    def start_usage(first: ChunkGenerated) -> dict[str, int]:
        out = MessagesOut("msg_1", "claude-x")
        later = ChunkGenerated(task_id="t", idx=1, text="Hi", origin="r")
        # The first group holds no block's content (a thinking not asked for): message_start
        # waits for the second, and is sent once.
        stream = out.opening(None, 0) + out.events(0, [first])  # type: ignore[arg-type]
        assert stream == ""
        events = parse(out.events(0, [later]) + out.events(0, [later]))
        assert [n for n, _ in events].count("message_start") == 1
        usage: dict[str, int] = events[0][1]["message"]["usage"]
        return usage

    said = ChunkGenerated(
        task_id="t", idx=0, text="", reasoning="Hm.", origin="r", prompt_tokens=30, cached_tokens=8
    )
    assert start_usage(said) == {
        "input_tokens": 22,  # as the final usage counts them: the cached ones apart
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 8,
    }
    # A runner from before the chunks said it: 0, as before.
    old = ChunkGenerated(task_id="t", idx=0, text="", origin="r")
    assert start_usage(old)["input_tokens"] == 0


def test_a_streamed_tool_use_message() -> None:
    calls = [("call_1", "get_weather", '{"city": "Paris"}'), ("call_2", "f", '{"a": [1, 2]}')]
    for text in ("", "Let me see"):
        events, r = streamed(text, calls, "tool_calls")
        starts = [d for n, d in events if n == "content_block_start"]
        kinds = ["text"] * bool(text) + ["tool_use", "tool_use"]
        assert [s["content_block"]["type"] for s in starts] == kinds
        assert [s["index"] for s in starts] == list(range(len(kinds)))
        assert starts[-1]["content_block"] == {
            "type": "tool_use",
            "id": "call_2",
            "name": "f",
            "input": {},
        }
        stops = [d["index"] for n, d in events if n == "content_block_stop"]
        assert stops == list(range(len(kinds)))  # each block stopped before the next starts
        assert accumulate(events) == whole_message("msg_1", "claude-x", r, USAGE)


def test_an_empty_stream_still_has_its_text_block() -> None:
    events, r = streamed("", [], "length")
    assert [n for n, _ in events][2:4] == ["content_block_start", "content_block_stop"]
    assert accumulate(events) == whole_message("msg_1", "claude-x", r, USAGE)
    assert accumulate(events)["stop_reason"] == "max_tokens"


def test_a_failure_is_an_error_event() -> None:
    [(name, data)] = parse(MessagesOut("m", "x").failure(ApiError(503, "no runner")))
    assert name == "error"
    assert data == {"type": "error", "error": {"type": "overloaded_error", "message": "no runner"}}


def test_the_model_list_in_anthropic_shape() -> None:
    listed = model_list([("smollm2-135m", 0), ("claude-shoal-test", 1_700_000_000)])
    assert listed == {
        "data": [
            {
                "type": "model",
                "id": "smollm2-135m",
                "display_name": "smollm2-135m",
                "created_at": "1970-01-01T00:00:00Z",
            },
            {
                "type": "model",
                "id": "claude-shoal-test",
                "display_name": "claude-shoal-test",
                "created_at": "2023-11-14T22:13:20Z",
            },
        ],
        "has_more": False,
        "first_id": "smollm2-135m",
        "last_id": "claude-shoal-test",
    }
    assert model_list([]) == {"data": [], "has_more": False, "first_id": None, "last_id": None}
