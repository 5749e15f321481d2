"""OpenAI's response objects made from chunks: tool calls, log-probabilities, echo, choices."""

from __future__ import annotations

import json

from api.openai.shapes import (
    Echo,
    Shape,
    chat_chunk,
    chat_completion,
    completion,
    completion_logprobs,
    tool_call_deltas,
    usage,
)
from api.reply import Reply
from events.catalogue import ChunkGenerated
from events.records import TokenLogprob, ToolCallDelta, TopLogprob, Usage


def chunk(idx: int, text: str = "", **fields: object) -> ChunkGenerated:
    return ChunkGenerated.model_validate(
        {"task_id": "t", "origin": "n", "idx": idx, "text": text, **fields}
    )


def lp(token: str, logprob: float | None, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(
        token=token,
        logprob=logprob,
        bytes=list(token.encode()),
        top=[TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in top],
    )


CALL = [
    chunk(0, "", tool_calls=[ToolCallDelta(index=0, id="call_1", name="weather")]),
    chunk(1, "", tool_calls=[ToolCallDelta(index=0, arguments='{"city": ')]),
    chunk(2, "", tool_calls=[ToolCallDelta(index=0, arguments='"Paris"}')]),
    chunk(3, "", tool_calls=[ToolCallDelta(index=1, id="call_2", name="time", arguments="{}")]),
    chunk(4, "", finish_reason="tool_calls"),
]


def test_a_reply_with_tool_calls_is_openais_message() -> None:
    reply = Reply()
    for c in CALL:
        reply.add(c)
    usages = [Usage(prompt_tokens=3, completion_tokens=4)]
    body = chat_completion(Shape("chatcmpl-x", "m", chat=True), [reply], usages, logprobs=False)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}},
    ]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def test_streamed_tool_calls_are_openais_deltas() -> None:
    shape = Shape("chatcmpl-x", "m", chat=True)
    deltas = [chat_chunk(shape, 0, [c], False, False) for c in CALL]
    first = deltas[0]
    assert first is not None
    assert first["choices"][0]["delta"] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": ""},
            }
        ]
    }
    later = deltas[1]
    assert later is not None
    assert later["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]
    }
    last = deltas[-1]
    assert last is not None and last["choices"][0]["finish_reason"] == "tool_calls"
    assert tool_call_deltas([ToolCallDelta(index=2, arguments="x")]) == [
        {"index": 2, "function": {"arguments": "x"}}
    ]


def test_a_chunk_with_nothing_to_say_is_not_sent() -> None:
    shape = Shape("chatcmpl-x", "m", chat=True)
    assert chat_chunk(shape, 0, [chunk(0, "")], False, False) is None
    with_role = chat_chunk(shape, 1, [chunk(0, "")], True, False)
    assert with_role is not None and with_role["choices"][0]["index"] == 1


def test_chat_logprobs_are_openais_shape() -> None:
    reply = Reply()
    reply.add(chunk(0, "Hi", logprob=lp("Hi", -0.25, ("Hi", -0.25), ("Hey", -2.0))))
    reply.add(chunk(1, "", finish_reason="stop"))
    usages = [Usage(prompt_tokens=1, completion_tokens=1)]
    body = chat_completion(Shape("c", "m", chat=True), [reply], usages, logprobs=True)
    content = body["choices"][0]["logprobs"]["content"]
    assert content == [
        {
            "token": "Hi",
            "logprob": -0.25,
            "bytes": [72, 105],
            "top_logprobs": [
                {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
                {"token": "Hey", "logprob": -2.0, "bytes": [72, 101, 121]},
            ],
        }
    ]
    streamed = chat_chunk(
        Shape("c", "m", chat=True), 0, [chunk(0, "Hi", logprob=lp("Hi", -0.25))], False, True
    )
    assert streamed is not None
    assert streamed["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.25


def test_completion_logprobs_with_echo_count_offsets_from_the_prompt() -> None:
    prompt = [lp("The", None), lp(" cat", -3.0, (" dog", -1.0))]
    reply = Reply()
    reply.add(chunk(0, " sat", logprob=lp(" sat", -0.5, (" sat", -0.5))))
    reply.add(chunk(1, "", finish_reason="length"))
    body = completion(
        Shape("cmpl-x", "m", chat=False),
        [reply],
        [Usage(prompt_tokens=2, completion_tokens=1)],
        logprobs=True,
        echo=Echo("The cat", prompt),
        prompt_chars=7,
    )
    choice = body["choices"][0]
    assert choice["text"] == "The cat sat" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["The", " cat", " sat"],
        "token_logprobs": [None, -3.0, -0.5],
        "top_logprobs": [None, {" dog": -1.0, " cat": -3.0}, {" sat": -0.5}],
        "text_offset": [0, 3, 7],
    }
    without_echo = completion_logprobs([lp(" sat", -0.5)], 7)
    assert without_echo["text_offset"] == [7] and without_echo["top_logprobs"] == [{" sat": -0.5}]


def test_choices_share_the_prompt_in_usage() -> None:
    usages = [
        Usage(prompt_tokens=5, completion_tokens=n, cached_tokens=4, reasoning_tokens=n - 1)
        for n in (2, 3)
    ]
    assert usage(usages) == {
        "prompt_tokens": 5,
        "completion_tokens": 5,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
        # Each choice's thinking is its own: counted for each, as its completion tokens are.
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
