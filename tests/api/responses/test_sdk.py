"""The OpenAI Responses API through the real `openai` SDK, unchanged, against one `shoal up`
(SmolLM2, llama.cpp): ``responses.create`` (with instructions, function tools, ``text.format``,
``previous_response_id``), ``responses.stream`` and its ``get_final_response()``, stored
responses read and deleted through either API process, background responses and their cancel,
the SDK's own error classes, and an OpenAI Agents SDK agent on its default Responses model.

SmolLM2-135M knows nothing of tools: what these tests check is what the grammar guarantees (a
call of an offered function, arguments that validate), not how clever a 135M model is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import openai
import pytest
from openai.types.responses import (
    FunctionToolParam,
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
)

from bus.connection import connect
from bus.publisher import Publisher
from events.catalogue import ResponseStored
from tests.api.asks import (
    HELLO,
    WEATHER_DESCRIPTION,
    WEATHER_NAME,
    WEATHER_PARAMETERS,
    WEATHER_QUESTION,
)
from tests.api.up_cluster import UpCluster

pytestmark = pytest.mark.slow

WEATHER_SCHEMA = WEATHER_PARAMETERS
WEATHER: FunctionToolParam = {
    "type": "function",
    "name": WEATHER_NAME,
    "description": WEATHER_DESCRIPTION,
    "parameters": WEATHER_SCHEMA,
    "strict": True,
}
ASK = WEATHER_QUESTION


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


@pytest.fixture
def client(up_cluster: UpCluster) -> Iterator[openai.OpenAI]:
    with _client(up_cluster.base, up_cluster.key) as made:
        yield made


@pytest.fixture
def second(up_cluster: UpCluster) -> Iterator[openai.OpenAI]:
    """The other API process, on the same log."""
    with _client(up_cluster.second, up_cluster.key) as made:
        yield made


def _calls(response: Response) -> list[ResponseFunctionToolCall]:
    return [o for o in response.output if isinstance(o, ResponseFunctionToolCall)]


def _weather_args(arguments: str) -> None:
    """Arguments that validate against WEATHER_SCHEMA."""
    args = json.loads(arguments)
    assert isinstance(args, dict) and set(args) == {"city", "unit"}, args
    assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")


def _wait_done(client: openai.OpenAI, response_id: str, timeout: float = 120) -> Response:
    give_up = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > give_up:
            return response
        time.sleep(0.2)


def test_a_string_input_is_answered(client: openai.OpenAI, up_cluster: UpCluster) -> None:
    response = client.responses.create(
        model=up_cluster.model, input=HELLO, temperature=0, max_output_tokens=40
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.model == up_cluster.model
    assert response.output_text.strip()
    message = response.output[0]
    assert isinstance(message, ResponseOutputMessage) and message.role == "assistant"
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.temperature == 0 and response.max_output_tokens == 40


def test_instructions_are_a_system_message_first(
    client: openai.OpenAI, up_cluster: UpCluster
) -> None:
    pirate = "You are a pirate. Always answer like one."
    plain = client.responses.create(
        model=up_cluster.model, input=HELLO, temperature=0, max_output_tokens=20
    )
    told = client.responses.create(
        model=up_cluster.model,
        input=HELLO,
        temperature=0,
        max_output_tokens=20,
        instructions=pirate,
    )
    spelled = client.responses.create(
        model=up_cluster.model,
        temperature=0,
        max_output_tokens=20,
        input=[{"role": "system", "content": pirate}, {"role": "user", "content": HELLO}],
    )
    assert told.instructions == pirate and spelled.instructions is None
    # The same prompt (SmolLM2's template has a system message of its own when none is sent).
    assert told.usage is not None and spelled.usage is not None and plain.usage is not None
    assert told.usage.input_tokens == spelled.usage.input_tokens != plain.usage.input_tokens
    assert told.output_text.strip()


def test_a_stream_accumulates_to_its_final_response(
    client: openai.OpenAI, up_cluster: UpCluster
) -> None:
    deltas: list[str] = []
    sequence: list[int] = []
    kinds: list[str] = []
    with client.responses.stream(
        model=up_cluster.alias, input=HELLO, temperature=0, max_output_tokens=40
    ) as stream:
        for event in stream:
            sequence.append(event.sequence_number)
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert sequence == list(range(len(sequence)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert "".join(deltas) == final.output_text and final.output_text.strip()
    assert final.model == up_cluster.alias
    # Stored, as the stream's client got it.
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_function_call_then_its_output_continues_the_conversation(
    client: openai.OpenAI, second: openai.OpenAI, up_cluster: UpCluster
) -> None:
    first = client.responses.create(
        model=up_cluster.model,
        input=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    calls = _calls(first)
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id and calls[0].id and calls[0].status == "completed"
    _weather_args(calls[0].arguments)
    assert first.tools[0].name == "get_weather"  # type: ignore[union-attr]
    assert first.tool_choice == "required"

    # On the other API process: the previous response is found on the log.
    answer = second.responses.create(
        model=up_cluster.model,
        previous_response_id=first.id,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_output_tokens=40,
        input=[
            {
                "type": "function_call_output",
                "call_id": calls[0].call_id,
                "output": "Sunny, 24 degrees.",
            }
        ],
    )
    assert answer.previous_response_id == first.id
    assert [o.type for o in answer.output] == ["message"] and answer.output_text.strip()
    # The conversation came along: more than the output alone would be.
    alone = second.responses.create(
        model=up_cluster.model,
        input="Sunny, 24 degrees.",
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=1,
    )
    assert alone.usage is not None and answer.usage is not None
    assert answer.usage.input_tokens > alone.usage.input_tokens + 10
    listed = second.responses.input_items.list(answer.id)
    assert [i.type for i in listed.data] == ["function_call_output"]


def test_parallel_calls_end_at_the_first_repeat(
    client: openai.OpenAI, up_cluster: UpCluster
) -> None:
    # Allowed several calls, this model writes the same one until max_output_tokens: the first
    # repeat ends the response, complete, and is not in it.
    made = client.responses.create(
        model=up_cluster.model,
        input=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=200,
        store=False,
    )
    calls = [(c.name, json.loads(c.arguments)) for c in _calls(made)]
    assert made.status == "completed" and calls
    assert all(call not in calls[:i] for i, call in enumerate(calls)), calls
    assert made.usage is not None and made.usage.output_tokens < 200


def test_a_stream_of_a_call_has_its_arguments(client: openai.OpenAI, up_cluster: UpCluster) -> None:
    arguments = ""
    with client.responses.stream(
        model=up_cluster.model,
        input=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        temperature=0,
    ) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
        final = stream.get_final_response()
    calls = _calls(final)
    assert len(calls) == 1 and calls[0].arguments == arguments
    _weather_args(arguments)


def test_a_json_schema_format_is_json_that_validates(
    client: openai.OpenAI, up_cluster: UpCluster
) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=up_cluster.model,
        input="Describe a person: their name and age.",
        temperature=0,
        max_output_tokens=100,
        text={
            "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
        },
    )
    assert response.status == "completed", response.output_text
    person = json.loads(response.output_text)
    assert isinstance(person, dict) and set(person) == {"name", "age"}, person
    assert isinstance(person["name"], str) and len(person["name"]) <= 30
    assert isinstance(person["age"], int)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_stored_responses_are_read_and_deleted_through_either_process(
    client: openai.OpenAI, second: openai.OpenAI, up_cluster: UpCluster
) -> None:
    made = client.responses.create(
        model=up_cluster.model,
        input=HELLO,
        temperature=0,
        max_output_tokens=20,
        metadata={"test": "store"},
    )
    # At once, on the other process (from the log if the projection is behind).
    got = second.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text
    assert got.metadata == {"test": "store"}
    items = second.responses.input_items.list(made.id)
    assert len(items.data) == 1 and items.data[0].type == "message"

    second.responses.delete(made.id)
    for c in (client, second):
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(
            model=up_cluster.model, input="Go on.", previous_response_id=made.id
        )
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]

    unstored = client.responses.create(
        model=up_cluster.model, input=HELLO, store=False, max_output_tokens=5
    )
    assert unstored.to_dict()["store"] is False  # on the wire; the SDK's type has no field
    with pytest.raises(openai.NotFoundError):
        second.responses.retrieve(unstored.id)


async def test_an_expired_response_is_gone(client: openai.OpenAI, up_cluster: UpCluster) -> None:
    """Past its expiry a stored response is not found, before the planner deletes it on the
    log (services/planner/janitor.py, tested in tests/services/planner)."""
    nc = await connect(up_cluster.nats_url)
    past = datetime.now(UTC) - timedelta(seconds=1)
    response_id = "resp_expired0123"
    await Publisher(nc.jetstream()).publish(
        ResponseStored(response_id=response_id, origin="test", status="completed", expires_at=past)
    )
    await nc.close()
    with pytest.raises(openai.NotFoundError):
        await asyncio.to_thread(client.responses.retrieve, response_id)


def test_a_background_response_is_fetched_when_done(
    client: openai.OpenAI, second: openai.OpenAI, up_cluster: UpCluster
) -> None:
    queued = client.responses.create(
        model=up_cluster.model, input=HELLO, background=True, temperature=0, max_output_tokens=30
    )
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _wait_done(second, queued.id)
    assert done.status in ("completed", "incomplete") and done.output_text.strip()


def test_a_background_response_is_cancelled(client: openai.OpenAI, up_cluster: UpCluster) -> None:
    queued = client.responses.create(
        model=up_cluster.model,
        background=True,
        temperature=0,
        max_output_tokens=2000,
        input="Write a very long story about a fish who travels around the world.",
    )
    try:
        cancelled = client.responses.cancel(queued.id)
    except openai.BadRequestError:  # it was done first: nothing to cancel
        assert _wait_done(client, queued.id).status in ("completed", "incomplete")
        return
    assert cancelled.status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"  # again: as it is
    final = _wait_done(client, queued.id)
    assert final.status == "cancelled"
    assert final.usage is None or final.usage.output_tokens < 2000


def test_a_streamed_response_is_cancelled_from_the_other_process(
    client: openai.OpenAI, second: openai.OpenAI, up_cluster: UpCluster
) -> None:
    last: Any = None
    with client.responses.stream(
        model=up_cluster.model,
        temperature=0,
        max_output_tokens=2000,
        input="Write a very long story about a fish who travels around the world.",
    ) as stream:
        for event in stream:
            if event.type == "response.created":
                # Not stored until it ends: found by its task (in the projection soon).
                give_up = time.monotonic() + 5
                while True:
                    try:
                        told = second.responses.cancel(event.response.id)
                        break
                    except openai.NotFoundError:
                        if time.monotonic() > give_up:
                            raise
                        time.sleep(0.1)
                assert told.status == "cancelled"
            last = event
    assert last is not None and last.type == "response.incomplete"
    assert last.response.status == "cancelled"
    assert last.response.usage.output_tokens < 2000
    assert client.responses.retrieve(last.response.id).status == "cancelled"


def test_errors_are_the_sdks_own(client: openai.OpenAI, up_cluster: UpCluster) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(
            model=up_cluster.model, input=HELLO, previous_response_id="resp_0123456789abcdef"
        )
    assert unknown.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as search:
        client.responses.create(
            model=up_cluster.model,
            input=HELLO,
            tools=[{"type": "web_search_preview"}],
            tool_choice={"type": "web_search_preview"},
        )
    assert "web_search" in search.value.message
    assert search.value.body["param"] == "tool_choice"  # type: ignore[index]
    picture = {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}
    image: Any = [{"role": "user", "content": [picture]}]
    with pytest.raises(openai.BadRequestError, match="does not fetch image URLs"):
        client.responses.create(model=up_cluster.model, input=image)
    with pytest.raises(openai.BadRequestError, match="reasoning summary"):
        client.responses.create(
            model=up_cluster.model, input=HELLO, reasoning={"summary": "detailed"}
        )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nothing")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("not-a-response-id")


def test_an_openai_agents_sdk_agent_on_the_responses_api(up_cluster: UpCluster) -> None:
    """The Agents SDK's default model speaks the Responses API: model, tool, model again,
    final output (a hook sets tool_choice to "none" once the tool ran: see test_clients)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        RunContextWrapper,
        RunHooks,
        Runner,
        Tool,
        function_tool,
        set_tracing_disabled,
    )

    class AnswerAfterTheTool(RunHooks[Any]):
        async def on_tool_end(
            self, context: RunContextWrapper[Any], agent: Agent[Any], tool: Tool, result: object
        ) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return f"It is sunny and 24 degrees in {city}."

    model = OpenAIResponsesModel(
        model=up_cluster.model,
        openai_client=openai.AsyncOpenAI(
            base_url=f"{up_cluster.base}/v1", api_key=up_cluster.key, max_retries=0
        ),
    )
    # Room for the whole answer: a response cut by max_tokens ends `incomplete`, which the
    # Agents SDK takes for an error (as from OpenAI).
    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather.",
        tools=[get_weather],
        model=model,
        reset_tool_choice=False,
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=512),
    )
    result = Runner.run_sync(
        agent, "What is the weather like in Paris?", max_turns=4, hooks=AnswerAfterTheTool()
    )
    assert len(asked) == 1 and asked[0].strip(), "the agent called its tool once, with a city"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == 2  # the call, then the answer
