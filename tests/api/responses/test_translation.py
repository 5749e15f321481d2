"""The Responses API, pure: a request body becomes a task's fields (or a 400 naming what Shoal
cannot honour), and chunks become the response object and stream events the openai SDK's own
types validate and its stream helper accumulates."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from api.errors import ApiError
from api.reply import Reply
from api.responses.requests import (
    ResponsesRequest,
    input_items,
    require_answered_calls,
    task_id_of,
    task_messages,
)
from api.responses.shapes import (
    Head,
    ResponsesOut,
    assistant_message,
    failed_response,
    final_response,
    output_items,
)
from events.catalogue import ChunkGenerated
from events.records import ChatMessage, ToolCall, ToolCallDelta, Usage

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields})


def refusal(**fields: Any) -> str:
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    return str(caught.value)


def chunk(idx: int, text: str = "", **fields: Any) -> ChunkGenerated:
    return ChunkGenerated.model_validate(
        {"task_id": "t", "origin": "n", "idx": idx, "text": text, **fields}
    )


def reply_of(chunks: list[ChunkGenerated]) -> Reply:
    reply = Reply()
    for c in chunks:
        reply.add(c)
    return reply


def head(body: ResponsesRequest | None = None) -> Head:
    return Head("resp_t", "t", "m", 1_700_000_000, (body or request()).echoed())


TEXT = [chunk(0, "Hello"), chunk(1, " there"), chunk(2, "", finish_reason="stop")]
# fmt: off
CALLS = [
    chunk(0, "", tool_calls=[ToolCallDelta(index=0, id="call_1", name="get_weather")]),
    chunk(1, "", tool_calls=[ToolCallDelta(index=0, arguments='{"city": ')]),
    chunk(2, "", tool_calls=[ToolCallDelta(index=0, arguments='"Paris"}')]),
    chunk(3, "", tool_calls=[ToolCallDelta(index=1, id="call_2", name="get_weather",
                                           arguments='{"city": "Rome"}')]),
    chunk(4, "", finish_reason="tool_calls"),
]
# fmt: on
USAGE = Usage(prompt_tokens=7, completion_tokens=3)


# --- requests -----------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    body = request(instructions="Be terse.")
    conversation = body.input_messages()
    assert conversation == [ChatMessage(role="user", content="Hi")]
    assert task_messages(body.instructions, conversation) == [
        ChatMessage(role="system", content="Be terse."),
        ChatMessage(role="user", content="Hi"),
    ]
    assert task_messages(None, conversation) == conversation


def test_items_become_a_chat_with_calls_and_their_outputs() -> None:
    body = request(
        input=[
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Paris?"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "Rain"}],
            },
        ]
    )
    messages = body.input_messages()
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[1].content == "Paris?"
    # The calls join the assistant message they follow: one turn of the model.
    assert messages[2].content == "Let me look."
    assert messages[2].tool_calls == [
        ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}'),
        ToolCall(id="c2", name="get_weather", arguments="{}"),
    ]
    assert [(m.tool_call_id, m.content) for m in messages[3:]] == [("c1", "Sunny"), ("c2", "Rain")]
    require_answered_calls(messages)
    listed = input_items(body.input, "t")
    assert [i["type"] for i in listed] == ["message"] * 3 + ["function_call"] * 2 + [
        "function_call_output"
    ] * 2
    assert len({i["id"] for i in listed}) == len(listed)
    assert listed[2]["content"][0]["type"] == "output_text"


def test_an_output_for_no_call_is_refused() -> None:
    body = request(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}])
    with pytest.raises(ApiError) as caught:
        require_answered_calls(body.input_messages())
    assert caught.value.status == 400 and "nope" in caught.value.message
    assert caught.value.param == "input"


def test_function_tools_choice_and_format_become_task_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = request(
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=12,
        temperature=0.5,
        top_p=0.9,
        text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
        metadata={"k": "v"},
        user="u",
    )
    fields = body.task_fields()
    assert [t.name for t in fields["tools"]] == ["get_weather"]
    assert fields["tools"][0].parameters == WEATHER["parameters"]
    assert (fields["tool_choice"].mode, fields["tool_choice"].name) == ("function", "get_weather")
    assert fields["parallel_tool_calls"] is False
    assert fields["response_format"].type == "json_schema"
    assert fields["response_format"].json_schema == schema
    params = body.sampling()
    assert (params.max_tokens, params.temperature, params.top_p) == (12, 0.5, 0.9)
    echoed = body.echoed()
    assert echoed["tools"][0]["name"] == "get_weather" and echoed["tools"][0]["strict"] is True
    assert echoed["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert echoed["text"]["format"]["schema"] == schema and echoed["metadata"] == {"k": "v"}
    assert echoed["store"] is True and echoed["parallel_tool_calls"] is False

    plain = request()
    assert plain.task_fields()["tool_choice"].mode == "none"
    assert plain.task_fields()["response_format"] is None
    assert request(tools=[WEATHER]).task_fields()["tool_choice"].mode == "auto"
    assert (
        request(text={"format": {"type": "json_object"}}).task_fields()["response_format"].type
        == "json_object"
    )
    assert request(store=False).keep is False and plain.keep is True


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            "tool_choice 'web_search' is not supported: Shoal runs no hosted tools",
        ),
        ({"tools": [{"type": "namespace", "name": "n", "tools": []}]}, "needs its tools"),
        (
            {"tools": [WEATHER, {"type": "namespace", "name": "n", "tools": [WEATHER]}]},
            "same name",
        ),
        ({"tools": [{"type": "computer_use_preview"}]}, "only your functions"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
            "type 'object'",
        ),
        ({"tools": [WEATHER, WEATHER]}, "same name"),
        ({"tool_choice": "required"}, "needs tools"),
        (
            {"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
            "not among the tools",
        ),
        ({"tool_choice": {"type": "web_search_preview"}}, "'web_search_preview' is not"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "an image",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "a file",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item references"),
        (
            {"input": [{"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]}]},
            "reasoning_text parts",
        ),
        ({"input": [{"type": "web_search_call"}]}, "'web_search_call' are not supported"),
        ({"input": []}, "input is empty"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning summary 'detailed'"),
        ({"reasoning": {"effort": "extreme"}}, "effort"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"text": {"format": {"type": "grammar"}}}, "'grammar' is not supported"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "needs its schema"),
        ({"text": {"verbosity": "low"}}, "verbosity"),
        ({"background": True, "store": False}, "background needs store"),
        ({"background": True, "stream": True}, "background with stream"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt is not supported"),
        ({"conversation": "conv_1"}, "conversation is not supported"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "at most 16"),
        ({"temperature": 3}, "temperature"),
    ],
)
def test_what_shoal_cannot_honour_is_refused(fields: dict[str, Any], says: str) -> None:
    assert says in refusal(**fields)


def test_what_does_not_change_the_answer_is_accepted() -> None:
    body = request(
        include=[],
        reasoning={"effort": None},
        truncation="auto",
        service_tier="auto",
        prompt_cache_key="k",
        safety_identifier="s",
        stream_options={"include_obfuscation": False},
        text={"format": {"type": "text"}, "verbosity": "medium"},
    )
    assert body.task_fields()["response_format"] is None
    # An empty input continues a previous response.
    assert request(input=[], previous_response_id="resp_x").input == []


def test_response_ids_name_their_task() -> None:
    assert task_id_of("resp_0123abc") == "0123abc"
    assert task_id_of("0123abc") is None
    assert task_id_of("resp_") is None
    assert task_id_of("resp_a.b>") is None


# --- response objects ----------------------------------------------------------------------


def test_a_text_reply_is_a_message_the_sdk_reads() -> None:
    reply = reply_of(TEXT)
    body = final_response(head(), output_items("t", reply), reply, USAGE)
    parsed = Response.model_validate(body)
    assert parsed.output_text == "Hello there"
    assert parsed.status == "completed" and parsed.id == "resp_t"
    assert parsed.usage is not None and parsed.usage.total_tokens == 10
    assert parsed.usage.input_tokens == 7 and parsed.usage.output_tokens == 3
    assert body["output"][0]["id"] == "msg_t" and body["completed_at"] is not None
    assert assistant_message(body["output"]) == ChatMessage(role="assistant", content="Hello there")


def test_calls_are_function_call_items() -> None:
    reply = reply_of(CALLS)
    output = output_items("t", reply)
    assert [i["type"] for i in output] == ["function_call", "function_call"]
    assert [(i["call_id"], i["arguments"]) for i in output] == [
        ("call_1", '{"city": "Paris"}'),
        ("call_2", '{"city": "Rome"}'),
    ]
    parsed = Response.model_validate(final_response(head(), output, reply, USAGE))
    assert parsed.output_text == ""
    message = assistant_message(output)
    assert [c.id for c in message.tool_calls] == ["call_1", "call_2"] and message.content == ""


def test_a_reply_cut_by_max_output_tokens_is_incomplete() -> None:
    reply = reply_of([chunk(0, "Hel"), chunk(1, "lo", finish_reason="length")])
    body = final_response(head(), output_items("t", reply), reply, USAGE)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][-1]["status"] == "incomplete" and body["completed_at"] is None
    Response.model_validate(body)


def test_an_empty_reply_is_an_empty_message_and_a_failure_has_its_error() -> None:
    reply = reply_of([chunk(0, "", finish_reason="stop")])
    output = output_items("t", reply)
    assert output[0]["content"][0]["text"] == ""
    failed = failed_response(head(), ApiError(500, "the task failed: boom"))
    parsed = Response.model_validate(failed)
    assert parsed.status == "failed" and parsed.error is not None
    assert parsed.error.code == "server_error" and "boom" in parsed.error.message
    invalid = failed_response(head(), ApiError(400, "invalid request: too long"))
    assert Response.model_validate(invalid).error.code == "invalid_prompt"  # type: ignore[union-attr]


# --- streams -------------------------------------------------------------------------------


def events_of(text: str) -> list[dict[str, Any]]:
    """Named SSE events, each checked: its name is its type."""
    out = []
    for block in text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {payload['type']}"
        out.append(payload)
    return out


def streamed(chunks: list[ChunkGenerated], keep: Any = None) -> tuple[str, ResponsesOut]:
    """What ResponsesOut streams for ``chunks`` arriving one group each."""
    out = ResponsesOut(head(), streaming=True, keep=keep)
    text = ""
    for i, c in enumerate(chunks):
        if i == 0:
            text += out.opening(None, 0)  # type: ignore[arg-type]
        text += out.events(0, [c])
    reply = reply_of(chunks)
    asyncio.run(out.done([reply], [USAGE]))
    return text + out.closing([reply], [USAGE]), out


def accumulated(events: list[dict[str, Any]]) -> Any:
    """The openai SDK's own stream helper over the events: its final response."""
    tools: Any = [WEATHER]
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=tools, text_format=omit)
    for e in events:
        state.handle_event(EVENTS.validate_python(e))
    return state._completed_response


def test_a_streamed_text_is_what_the_sdk_accumulates() -> None:
    text, out = streamed(TEXT)
    events = events_of(text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = accumulated(events)
    assert final is not None and final.output_text == deltas == "Hello there"
    assert events[-1]["response"] == out.final
    # Streamed or whole, the same response.
    reply = reply_of(TEXT)
    whole = final_response(head(), output_items("t", reply), reply, USAGE)
    assert {**events[-1]["response"], "completed_at": 0} == {**whole, "completed_at": 0}


def test_streamed_calls_are_items_with_argument_deltas() -> None:
    text, _ = streamed(CALLS)
    events = events_of(text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["call_id"]) for e in added] == [
        (0, "call_1"),
        (1, "call_2"),
    ]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "Rome"}'),
    ]
    final = accumulated(events)
    assert [o.arguments for o in final.output] == ['{"city": "Paris"}', '{"city": "Rome"}']
    assert json.loads(final.output[0].arguments) == {"city": "Paris"}
    reply = reply_of(CALLS)
    assert events[-1]["response"]["output"] == output_items("t", reply)


def test_text_then_a_call_closes_the_message_first() -> None:
    chunks = [
        chunk(0, "Checking."),
        chunk(
            1, "", tool_calls=[ToolCallDelta(index=0, id="c", name="get_weather", arguments="{}")]
        ),
        chunk(2, "", finish_reason="tool_calls"),
    ]
    events = events_of(streamed(chunks)[0])
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.done") < kinds.index(
        "response.function_call_arguments.delta"
    )
    final = accumulated(events)
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output_text == "Checking."


def test_a_stream_cut_by_max_output_tokens_ends_incomplete() -> None:
    events = events_of(streamed([chunk(0, "Hel"), chunk(1, "lo", finish_reason="length")])[0])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "incomplete"
    item_done = [e for e in events if e["type"] == "response.output_item.done"]
    assert item_done[-1]["item"]["status"] == "incomplete"
    for e in events:
        EVENTS.validate_python(e)


def test_a_failed_stream_ends_with_response_failed() -> None:
    out = ResponsesOut(head(), streaming=True, keep=None)
    text = out.opening(None, 0) + out.events(0, [chunk(0, "Hi")])  # type: ignore[arg-type]
    text += out.failure(ApiError(504, "the task took longer than the API waits"))
    events = events_of(text)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"].startswith("the task took longer")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # A failure before any chunk still starts the stream as the SDK expects.
    early = events_of(ResponsesOut(head(), True, None).failure(ApiError(400, "invalid request")))
    assert [e["type"] for e in early] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]


def test_a_kept_response_is_given_with_its_turn_and_one_not_kept_says_so() -> None:
    kept: list[tuple[dict[str, Any], ChatMessage | None]] = []

    async def keep(response: dict[str, Any], turn: ChatMessage | None) -> bool:
        kept.append((response, turn))
        return True

    _, out = streamed(TEXT, keep)
    assert out.final is not None and out.final["store"] is True
    assert kept == [(out.final, ChatMessage(role="assistant", content="Hello there"))]

    async def refuse(response: dict[str, Any], turn: ChatMessage | None) -> bool:
        return False

    whole = ResponsesOut(head(), streaming=False, keep=refuse)
    asyncio.run(whole.done([reply_of(TEXT)], [USAGE]))
    answer = whole.whole([reply_of(TEXT)], [USAGE], None)  # type: ignore[arg-type]
    assert answer["store"] is False and answer["output"][0]["content"][0]["text"] == "Hello there"
