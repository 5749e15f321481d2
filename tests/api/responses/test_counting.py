"""The Responses API's input-token count (``POST /v1/responses/input_tokens``): pure, the question
asked of the model's runner holds the task a response of the same body would be generated from;
against one `shoal up` (SmolLM2, llama.cpp) through the real `openai` SDK, the SDK's
``responses.input_tokens.count`` is a real ``responses.create``'s ``usage.input_tokens``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.responses import FunctionToolParam, Response, ResponseInputParam
from openai.types.responses.input_token_count_response import InputTokenCountResponse
from pydantic import ValidationError

from api.errors import ApiError
from api.responses.counting import count_question, input_tokens
from api.responses.requests import ResponsesBody, ResponsesRequest, chat_task, continued
from events.records import ChatMessage, ToolCall
from events.tokenizer import TokenizerAnswer
from tests.api.asks import (
    HELLO,
    WEATHER_DESCRIPTION,
    WEATHER_NAME,
    WEATHER_PARAMETERS,
    WEATHER_QUESTION,
)
from tests.api.up_cluster import UpCluster

WEATHER: FunctionToolParam = {
    "type": "function",
    "name": WEATHER_NAME,
    "description": WEATHER_DESCRIPTION,
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
# A conversation the model called a tool in, and the tool's answer.
ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
CALLED: ResponseInputParam = [
    {"role": "user", "content": WEATHER_QUESTION},
    {
        "type": "function_call",
        "call_id": "call_1",
        "name": WEATHER_NAME,
        "arguments": ARGUMENTS,
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 degrees."},
]
# What the SDK's ``input_tokens.count`` may send, all of it.
COUNTED_FIELDS: dict[str, Any] = {
    "model": "m",
    "input": CALLED,
    "instructions": "You are brief.",
    "tools": [WEATHER],
    "tool_choice": {"type": "function", "name": WEATHER_NAME},
    "parallel_tool_calls": False,
    "text": {"format": {"type": "json_object"}},
    "reasoning": {"effort": "none"},
    "truncation": "disabled",
}


# --- the question, pure ---------------------------------------------------------------------


def test_the_question_holds_the_task_a_response_of_the_same_body_has() -> None:
    previous = [
        ChatMessage(role="user", content="Before."),
        ChatMessage(role="assistant", content="Earlier answer."),
    ]
    body = ResponsesBody.model_validate(COUNTED_FIELDS)
    asked = count_question(body, continued(previous, body), "m-id", "api")
    assert asked.count_only and asked.add_generation_prompt and not asked.with_pieces
    # What the runner renders: a create of the same fields has the same (and only its sampling,
    # which the prompt does not depend on, differs).
    create = ResponsesRequest.model_validate(COUNTED_FIELDS | {"max_output_tokens": 5})
    made = chat_task(create, continued(previous, create), "m-id", "api", create.sampling())
    rendered = ("model_id", "kind", "messages", "tools", "tool_choice", "parallel_tool_calls")
    for field in (*rendered, "response_format", "thinking"):
        assert getattr(asked.task, field) == getattr(made, field), field
    messages = asked.task.messages or []
    roles = ["system", "user", "assistant", "user", "assistant", "tool"]
    assert [m.role for m in messages] == roles
    assert messages[0].content == "You are brief." and messages[1:3] == previous
    call = ToolCall(id="call_1", name=WEATHER_NAME, arguments=ARGUMENTS)
    assert messages[4].tool_calls == [call] and messages[5].tool_call_id == "call_1"
    assert [t.name for t in asked.task.tools] == [WEATHER_NAME]
    assert asked.task.tool_choice.name == WEATHER_NAME and asked.task.thinking is False
    assert asked.task.response_format is not None
    assert asked.task.response_format.type == "json_object"


def test_the_answer_is_the_sdks_count() -> None:
    counted = InputTokenCountResponse.model_validate(input_tokens(TokenizerAnswer(count=42)))
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", 42)


def test_what_the_count_cannot_honour_is_refused() -> None:
    def refusal(**fields: Any) -> str:
        with pytest.raises(ValidationError) as caught:
            ResponsesBody.model_validate({"model": "m", "input": HELLO, **fields})
        return str(caught.value)

    assert "conversation is not supported" in refusal(conversation="conv_1")
    assert "personality is not supported" in refusal(personality="friendly")
    assert "computer_use_preview" in refusal(tools=[{"type": "computer_use_preview"}])
    assert "needs tools" in refusal(tool_choice="required")
    assert "reasoning summary" in refusal(reasoning={"summary": "detailed"})
    assert "input is empty" in refusal(input=[])
    picture = {"type": "input_image", "file_id": "file_1"}
    assert "file ids are not supported" in refusal(input=[{"role": "user", "content": [picture]}])
    # An output answering no call of the conversation: OpenAI's 400, about the input.
    body = ResponsesBody.model_validate(
        {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}
    )
    with pytest.raises(ApiError) as caught:
        continued([], body)
    assert (caught.value.status, caught.value.param) == (400, "input")


# --- through the SDK, against a real cluster ---------------------------------------------


@pytest.fixture
def client(up_cluster: UpCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{up_cluster.base}/v1", api_key=up_cluster.key, max_retries=0
    ) as made:
        yield made


def _used(client: openai.OpenAI, model: str, **fields: Any) -> int:
    """The input tokens of a real response (one token long) of the same fields."""
    made: Response = client.responses.create(
        model=model, max_output_tokens=1, temperature=0, **fields
    )
    assert made.usage is not None
    return made.usage.input_tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields",
    [
        {"input": WEATHER_QUESTION},
        {"input": WEATHER_QUESTION, "instructions": "You are brief."},
        {"input": WEATHER_QUESTION, "tools": [WEATHER]},
        {
            "input": CALLED,
            "instructions": "You are brief.",
            "tools": [WEATHER],
            "tool_choice": "required",
        },
    ],
    ids=["plain", "instructions", "tools", "a-call-answered"],
)
def test_the_sdks_count_is_a_responses_input_tokens(
    client: openai.OpenAI, up_cluster: UpCluster, fields: dict[str, Any]
) -> None:
    counted = client.responses.input_tokens.count(model=up_cluster.model, **fields)
    assert isinstance(counted, InputTokenCountResponse)
    assert counted.object == "response.input_tokens" and counted.input_tokens > 0
    assert counted.input_tokens == _used(client, up_cluster.model, **fields)


@pytest.mark.slow
def test_a_previous_responses_conversation_is_counted(
    client: openai.OpenAI, up_cluster: UpCluster
) -> None:
    first = client.responses.create(
        model=up_cluster.model,
        input=WEATHER_QUESTION,
        instructions="You are brief.",
        max_output_tokens=8,
        temperature=0,
    )
    then: dict[str, Any] = {"input": "And tomorrow?", "previous_response_id": first.id}
    counted = client.responses.input_tokens.count(model=up_cluster.model, **then).input_tokens
    alone = client.responses.input_tokens.count(model=up_cluster.model, input="And tomorrow?")
    assert counted > alone.input_tokens
    assert counted == _used(client, up_cluster.model, **then)


@pytest.mark.slow
def test_errors_are_the_sdks_own(client: openai.OpenAI, up_cluster: UpCluster) -> None:
    count = client.responses.input_tokens.count
    with pytest.raises(openai.BadRequestError, match="conversation is not supported"):
        count(model=up_cluster.model, input=HELLO, conversation="conv_1")
    with pytest.raises(openai.NotFoundError) as unknown:
        count(model=up_cluster.model, input=HELLO, previous_response_id="resp_0123456789abcdef")
    assert unknown.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    orphan: ResponseInputParam = [
        {"type": "function_call_output", "call_id": "nope", "output": "x"}
    ]
    with pytest.raises(openai.BadRequestError) as unanswered:
        count(model=up_cluster.model, input=orphan)
    assert unanswered.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        count(model="no-such-model", input=HELLO)
    keyless = openai.OpenAI(base_url=f"{up_cluster.base}/v1", api_key="wrong", max_retries=0)
    with keyless, pytest.raises(openai.AuthenticationError):
        keyless.responses.input_tokens.count(model=up_cluster.model, input=HELLO)
