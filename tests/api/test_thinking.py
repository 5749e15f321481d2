"""A thinking model's thinking in every dialect's own shape, from the same chunks: what each
request asks (``TaskCreated.thinking``, the template's variables), how the thinking comes back
(whole and streamed), and how an earlier turn's thinking goes back to the model."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response
from pydantic import ValidationError

from api.anthropic.messages import MessagesOut, MessagesRequest
from api.anthropic.shapes import signature, whole_message
from api.ollama.replies import OllamaOut
from api.ollama.translate import VERSION, ChatRequest, GenerateRequest
from api.openai.requests import ChatCompletionRequest
from api.openai.shapes import Shape, chat_chunk, chat_completion
from api.reply import Reply
from api.responses.requests import ResponsesRequest, chat_messages
from api.responses.shapes import Head, ResponsesOut, assistant_message, output_items
from api.thinking import EFFORT_BUDGETS, with_default_budget
from events.catalogue import ChunkGenerated, TaskCreated
from events.records import ChatMessage, ToolCallDelta, Usage

USAGE = Usage(prompt_tokens=5, completion_tokens=4)
ASK = [{"role": "user", "content": "2 + 2?"}]


def chunk(idx: int, text: str = "", reasoning: str = "", **fields: Any) -> ChunkGenerated:
    return ChunkGenerated.model_validate(
        {"task_id": "t", "origin": "n", "idx": idx, "text": text, "reasoning": reasoning, **fields}
    )


# Thinking over two chunks, then the answer; the last chunk ends it.
CHUNKS = [
    chunk(0, reasoning="Two and"),
    chunk(1, reasoning=" two."),
    chunk(2, "It is 4."),
    chunk(3, finish_reason="stop"),
]


def reply_of(chunks: list[ChunkGenerated]) -> Reply:
    r = Reply()
    for c in chunks:
        r.add(c)
    return r


def test_the_reply_keeps_the_thinking_apart() -> None:
    r = reply_of(CHUNKS)
    assert (r.reasoning, r.text) == ("Two and two.", "It is 4.")


# --- OpenAI chat ----------------------------------------------------------------------------


def openai(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **fields})


def test_openai_reasoning_effort_and_template_variables() -> None:
    assert openai().task_fields()["thinking"] is None
    assert openai(reasoning_effort="none").task_fields()["thinking"] is False
    assert openai(reasoning_effort="high").task_fields()["thinking"] is True
    kwargs = {"enable_thinking": False}
    assert openai(chat_template_kwargs=kwargs).task_fields()["chat_template_kwargs"] == kwargs
    with pytest.raises(ValidationError, match="may not set 'messages'"):
        openai(chat_template_kwargs={"messages": []})
    with pytest.raises(ValidationError, match="reasoning_effort"):
        openai(reasoning_effort="extreme")


def test_efforts_are_budgets_by_one_table() -> None:
    budgets = list(EFFORT_BUDGETS.values())
    assert budgets == sorted(budgets) and list(EFFORT_BUDGETS) == [
        "minimal",
        "low",
        "medium",
        "high",
        "xhigh",
    ]
    assert openai().task_fields()["thinking_budget"] is None
    assert openai(reasoning_effort="none").task_fields()["thinking_budget"] is None
    for effort, budget in EFFORT_BUDGETS.items():
        fields = openai(reasoning_effort=effort).task_fields()
        assert (fields["thinking"], fields["thinking_budget"]) == (True, budget)
        fields = responses(reasoning={"effort": effort}).task_fields()
        assert (fields["thinking"], fields["thinking_budget"]) == (True, budget)


def test_the_servers_default_budget_fills_what_a_request_left_open() -> None:
    def task(**fields: Any) -> TaskCreated:
        return TaskCreated(task_id="t", model_id="m", origin="o", **fields)

    assert with_default_budget(task(), 512).thinking_budget == 512
    assert with_default_budget(task(thinking=True), 512).thinking_budget == 512
    assert with_default_budget(task(thinking_budget=64), 512).thinking_budget == 64
    assert with_default_budget(task(thinking=False), 512).thinking_budget is None
    assert with_default_budget(task(), None).thinking_budget is None
    with pytest.raises(ValidationError):
        task(thinking_budget=0)


def test_openai_history_sends_the_thinking_back() -> None:
    body = openai(
        messages=[
            *ASK,
            {"role": "assistant", "content": "4.", "reasoning_content": "Easy."},
            {"role": "user", "content": "And 3 + 3?", "reasoning_content": "ignored"},
        ]
    )
    assert [m.reasoning for m in body.chat_messages()] == [None, "Easy.", None]


def test_openai_reasoning_content_whole_and_streamed() -> None:
    shape = Shape("chatcmpl-t", "m", chat=True)
    r = reply_of(CHUNKS)
    whole = ChatCompletion.model_validate(chat_completion(shape, [r], [USAGE], False))
    assert whole.choices[0].message.content == "It is 4."
    assert whole.choices[0].message.model_extra == {"reasoning_content": "Two and two."}
    hidden = chat_completion(shape, [r], [USAGE], False, reasoning=False)
    assert "reasoning_content" not in hidden["choices"][0]["message"]
    deltas = [chat_chunk(shape, 0, [c], False, False) for c in CHUNKS]
    parsed = [ChatCompletionChunk.model_validate(d) for d in deltas if d is not None]
    thought = "".join(
        (p.choices[0].delta.model_extra or {}).get("reasoning_content", "") for p in parsed
    )
    assert thought == "Two and two."
    assert "".join(p.choices[0].delta.content or "" for p in parsed) == "It is 4."
    assert chat_chunk(shape, 0, [CHUNKS[0]], False, False, reasoning=False) is None


# --- Anthropic ------------------------------------------------------------------------------


def anthropic(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 64, "messages": ASK, **fields}
    )


def test_anthropic_thinks_only_when_asked() -> None:
    assert anthropic().task_fields()["thinking"] is False
    assert anthropic(thinking={"type": "disabled"}).task_fields()["thinking"] is False
    enabled = anthropic(thinking={"type": "enabled", "budget_tokens": 2048})
    assert enabled.task_fields()["thinking"] is True and enabled.thinks
    assert anthropic(thinking={"type": "adaptive"}).thinks


def test_anthropic_budget_tokens_is_the_budget() -> None:
    enabled = anthropic(thinking={"type": "enabled", "budget_tokens": 2048})
    assert enabled.task_fields()["thinking_budget"] == 2048
    # Adaptive: the model's own (or the server's default); no budget without thinking.
    assert anthropic(thinking={"type": "adaptive"}).task_fields()["thinking_budget"] is None
    assert anthropic(thinking={"type": "enabled"}).task_fields()["thinking_budget"] is None
    assert anthropic().task_fields()["thinking_budget"] is None
    with pytest.raises(ValidationError, match="budget_tokens"):
        anthropic(thinking={"type": "enabled", "budget_tokens": 0})
    # output_config.effort: the budget of adaptive (or budgetless) thinking, and nothing else.
    effort = {"output_config": {"effort": "low"}}
    assert (
        anthropic(thinking={"type": "adaptive"}, **effort).task_fields()["thinking_budget"] == 1024
    )
    high = {"type": "enabled", "budget_tokens": 2048}
    assert anthropic(thinking=high, **effort).task_fields()["thinking_budget"] == 2048
    assert anthropic(**effort).task_fields()["thinking_budget"] is None
    most = {"output_config": {"effort": "max"}}
    assert anthropic(thinking={"type": "adaptive"}, **most).task_fields()["thinking_budget"] is None


def test_anthropic_thinking_block_first() -> None:
    r = reply_of(CHUNKS)
    shown = whole_message("msg_t", "m", r, USAGE, thinking=True)["content"]
    assert shown == [
        {"type": "thinking", "thinking": "Two and two.", "signature": signature("Two and two.")},
        {"type": "text", "text": "It is 4."},
    ]
    assert whole_message("msg_t", "m", r, USAGE)["content"] == [
        {"type": "text", "text": "It is 4."}
    ]


def sse_events(stream: str) -> list[dict[str, Any]]:
    return [
        json.loads(block.split("\n")[1].removeprefix("data: "))
        for block in stream.strip().split("\n\n")
    ]


@pytest.mark.parametrize("thinking", [True, False])
def test_anthropic_streamed_thinking(thinking: bool) -> None:
    out = MessagesOut("msg_t", "m", thinking)
    stream = out.opening(None, 0)  # type: ignore[arg-type]
    stream += "".join(out.events(0, [c]) for c in CHUNKS)
    stream += out.closing([reply_of(CHUNKS)], [USAGE])
    events = sse_events(stream)
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    if not thinking:
        assert blocks == ["text"] and [d["type"] for d in deltas] == ["text_delta"]
        return
    assert blocks == ["thinking", "text"]
    assert [d["type"] for d in deltas] == [
        "thinking_delta",
        "thinking_delta",
        "signature_delta",
        "text_delta",
    ]
    assert "".join(d.get("thinking", "") for d in deltas) == "Two and two."
    assert deltas[2]["signature"] == signature("Two and two.")
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]


def test_anthropic_history_thinking_goes_to_the_template() -> None:
    body = anthropic(
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Easy.", "signature": "x"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "4."},
                ],
            },
            {"role": "user", "content": "And 3 + 3?"},
        ]
    )
    assert [m.reasoning for m in body.chat_messages()] == [None, "Easy.", None]


# --- Ollama ---------------------------------------------------------------------------------


def test_ollama_reports_a_version_with_think() -> None:
    major, minor, _ = (int(p) for p in VERSION.split("."))
    assert (major, minor) >= (0, 9)  # Open WebUI and the ollama client gate think on it


def test_ollama_think() -> None:
    chat = ChatRequest.model_validate({"messages": ASK, "think": True})
    assert chat.task_fields()["thinking"] is True
    generate = GenerateRequest.model_validate({"prompt": "2 + 2?", "think": False})
    assert generate.task_fields()["thinking"] is False
    assert generate.task_fields()["thinking_budget"] is None


def test_ollama_think_levels_are_budgets() -> None:
    for level in ("low", "medium", "high"):
        fields = ChatRequest.model_validate({"messages": ASK, "think": level}).task_fields()
        assert (fields["thinking"], fields["thinking_budget"]) == (True, EFFORT_BUDGETS[level])
        generate = GenerateRequest.model_validate({"prompt": "2 + 2?", "think": level})
        assert generate.task_fields()["thinking_budget"] == EFFORT_BUDGETS[level]
    with pytest.raises(ValidationError, match="think"):
        ChatRequest.model_validate({"messages": ASK, "think": "extreme"})


def test_ollama_thinking_whole_and_streamed() -> None:
    r = reply_of(CHUNKS)
    chat = OllamaOut("m", chat=True, logprobs=False).whole([r], [USAGE], None)  # type: ignore[arg-type]
    assert chat["message"] == {
        "role": "assistant",
        "content": "It is 4.",
        "thinking": "Two and two.",
    }
    generate = OllamaOut("m", chat=False, logprobs=False).whole([r], [USAGE], None)  # type: ignore[arg-type]
    assert (generate["response"], generate["thinking"]) == ("It is 4.", "Two and two.")
    hidden = OllamaOut("m", True, False, thinking=False).whole([r], [USAGE], None)  # type: ignore[arg-type]
    assert "thinking" not in hidden["message"]
    out = OllamaOut("m", chat=True, logprobs=False)
    lines = [json.loads(x) for x in out.events(0, CHUNKS).splitlines()]
    assert [x["message"].get("thinking", "") for x in lines] == ["Two and", " two.", ""]
    assert [x["message"]["content"] for x in lines] == ["", "", "It is 4."]
    hidden_lines = OllamaOut("m", True, False, thinking=False).events(0, CHUNKS).splitlines()
    assert [json.loads(x)["message"]["content"] for x in hidden_lines] == ["It is 4."]


# --- Responses ------------------------------------------------------------------------------


def responses(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "2 + 2?", **fields})


def head(body: ResponsesRequest) -> Head:
    return Head("resp_t", "t", "m", 1_700_000_000, body.echoed())


def test_responses_reasoning_effort() -> None:
    assert responses().task_fields()["thinking"] is None
    assert responses(reasoning={"effort": "none"}).task_fields()["thinking"] is False
    body = responses(reasoning={"effort": "low", "summary": "auto"})
    assert body.task_fields()["thinking"] is True
    assert body.echoed()["reasoning"] == {"effort": "low", "summary": "auto"}


def test_responses_reasoning_item_first() -> None:
    r = reply_of(CHUNKS)
    output = output_items("t", r)
    assert output[0] == {
        "type": "reasoning",
        "id": "rs_t",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Two and two."}],
        "status": "completed",
    }
    assert [i["type"] for i in output] == ["reasoning", "message"]
    assert [i["type"] for i in output_items("t", r, reasoning=False)] == ["message"]
    # A response continued later carries its thinking to the template.
    assert assistant_message(output) == ChatMessage(
        role="assistant", content="It is 4.", reasoning="Two and two."
    )


def test_responses_streamed_reasoning() -> None:
    body = responses()
    out = ResponsesOut(head(body), streaming=True, keep=None)
    text = out.opening(None, 0)  # type: ignore[arg-type]
    text += "".join(out.events(0, [c]) for c in CHUNKS)
    r = reply_of(CHUNKS)
    asyncio.run(out.done([r], [USAGE]))
    events = sse_events(text + out.closing([r], [USAGE]))
    kinds = [e["type"] for e in events]
    assert kinds[2:8] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
    ]
    final = Response.model_validate(events[-1]["response"])
    assert final.output[0].type == "reasoning" and final.output_text == "It is 4."
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]


def test_responses_reasoning_items_in_input() -> None:
    body = responses(
        input=[
            {"role": "user", "content": "Weather?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Call it."}],
            },
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
            {"role": "assistant", "content": "Sunny."},
        ]
    )
    messages = chat_messages(body.input)
    assert [(m.role, m.reasoning) for m in messages] == [
        ("user", None),
        ("assistant", "Call it."),
        ("tool", None),
        ("assistant", None),
    ]


def test_a_call_after_the_thinking_is_still_a_call() -> None:
    chunks = [
        chunk(0, reasoning="I need the weather."),
        chunk(1, tool_calls=[ToolCallDelta(index=0, id="c", name="get_weather", arguments="{}")]),
        chunk(2, finish_reason="tool_calls"),
    ]
    r = reply_of(chunks)
    whole = chat_completion(Shape("x", "m", chat=True), [r], [USAGE], False)
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "I need the weather."
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert [i["type"] for i in output_items("t", r)] == ["reasoning", "function_call"]
