"""plan_reply: the chat, tools, grammar and parser each format and tool choice get."""

from __future__ import annotations

import json
from typing import Any

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from events.catalogue import TaskCreated
from events.records import ChatMessage, ResponseFormat, Tool, ToolCall, ToolChoice
from structured import ReplyPlan, plan_reply, tool_format
from structured.formats import call_id, history_id
from structured.reply import InvalidRequest, PlainReply
from tests.structured import oracle

WEATHER = Tool(
    name="get_weather",
    description="The current weather in a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
)
TIME = Tool(name="get_time", description="The time now")

# Short excerpts holding each format's markers (not the whole templates).
HERMES = "{%- if tools %}<tools>{{ tools | tojson }}</tools> <tool_call>{%- endif %}"
LLAMA3 = "<|start_header_id|>ipython<|end_header_id|>{{- '<|python_tag|>' + tool_call.name }}"
MISTRAL = '{{- "[TOOL_CALLS] [" }}{{ tool_call.id }}'
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}"
)
TEMPLATES: dict[str, str | None] = {
    "hermes": HERMES,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
    "generic": CHATML,
}

HISTORY = [
    ChatMessage(role="user", content="Weather in Paris and the time?"),
    ChatMessage(
        role="assistant",
        content="Let me check.",
        tool_calls=[
            ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
            ToolCall(id="call_2", name="get_time", arguments="not json"),
        ],
    ),
    ChatMessage(role="tool", tool_call_id="call_1", content="Sunny, 21 °C"),
    ChatMessage(role="tool", tool_call_id="call_2", name="get_time", content="12:00"),
]


def task(**fields: Any) -> TaskCreated:
    base: dict[str, Any] = {
        "task_id": "t1",
        "model_id": "m",
        "origin": "test",
        "messages": [ChatMessage(role="user", content="Weather in Paris?")],
        "tools": [WEATHER, TIME],
    }
    return TaskCreated(**(base | fields))


def reply(plan: ReplyPlan, text: str) -> tuple[str, list[tuple[str | None, str]]]:
    parser = plan.parser()
    parsed = [parser.feed(c) for c in text] + [parser.finish()]
    calls: dict[int, list[Any]] = {}
    for delta in (d for p in parsed for d in p.calls):
        calls.setdefault(delta.index, [delta.name, ""])[1] += delta.arguments
    return "".join(p.text for p in parsed), [(n, a) for n, a in calls.values()]


def test_the_format_comes_from_the_template() -> None:
    assert tool_format(None) == "generic"
    assert tool_format("") == "generic"
    assert tool_format(HERMES) == "hermes"
    assert tool_format(LLAMA3) == "llama3"
    assert tool_format("<|start_header_id|>{{ role }}") == "generic"  # Llama 3.0: no tools
    assert tool_format(MISTRAL) == "mistral"
    assert tool_format(CHATML) == "generic"
    assert tool_format(oracle.chat_template()) == "generic"  # SmolLM2's
    assert tool_format("<tool_call>\n<function=f>") == "generic"  # Qwen3-Coder's XML calls


def test_mistral_history_ids_are_nine_letters_and_digits() -> None:
    assert history_id("mistral", "a1B2c3D4e") == "a1B2c3D4e"
    mapped = history_id("mistral", "call_abc")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == history_id("mistral", "call_abc")
    assert history_id("hermes", "call_abc") == "call_abc"


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_native_auto_passes_the_tools_and_a_lazy_grammar(fmt: str) -> None:
    plan = plan_reply(task(), TEMPLATES[fmt])
    assert plan.format == fmt
    assert plan.messages == [{"role": "user", "content": "Weather in Paris?"}]
    assert plan.tools is not None
    assert plan.tools[0] == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER.parameters,
        },
    }
    assert plan.grammar is not None and plan.grammar.triggers
    assert oracle.accepts(plan.grammar, "It is sunny in Paris, probably.")
    assert oracle.parses(plan.grammar.gbnf)


CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "generic": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
}


@pytest.mark.parametrize("fmt", list(CALLS))
@pytest.mark.parametrize("mode", ["auto", "required", "function"])
def test_a_call_the_grammar_allows_is_read_back(fmt: str, mode: Any) -> None:
    choice = ToolChoice(mode=mode, name="get_weather" if mode == "function" else None)
    plan = plan_reply(task(tool_choice=choice), TEMPLATES[fmt])
    assert plan.grammar is not None
    assert oracle.accepts(plan.grammar, CALLS[fmt])
    assert reply(plan, CALLS[fmt]) == ("", [("get_weather", '{"city": "Paris"}')])
    if mode != "auto":
        assert not plan.grammar.triggers
        assert not oracle.accepts(plan.grammar, "It is sunny.")
    parser = plan.parser()
    parser.feed(CALLS[fmt])
    parser.finish()
    assert parser.called


def test_a_named_function_is_the_only_one_allowed() -> None:
    plan = plan_reply(task(tool_choice=ToolChoice(mode="function", name="get_time")), HERMES)
    assert plan.grammar is not None
    assert not oracle.accepts(plan.grammar, CALLS["hermes"])
    assert oracle.accepts(
        plan.grammar, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert plan.tools is not None and len(plan.tools) == 2  # the template still sees them all


def test_parallel_calls_or_one() -> None:
    two = CALLS["hermes"] + "\n" + CALLS["hermes"]
    several = plan_reply(task(tool_choice=ToolChoice(mode="required")), HERMES)
    one = plan_reply(
        task(tool_choice=ToolChoice(mode="required"), parallel_tool_calls=False), HERMES
    )
    assert several.grammar is not None and one.grammar is not None
    assert oracle.accepts(several.grammar, two)
    assert not oracle.accepts(one.grammar, two)


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_tool_choice_none_describes_no_tools_and_constrains_nothing(fmt: str) -> None:
    plan = plan_reply(task(tool_choice=ToolChoice(mode="none"), messages=HISTORY), TEMPLATES[fmt])
    assert plan.tools is None
    assert plan.grammar is None
    assert isinstance(plan.parser(), PlainReply)
    assert all("You can use these tools" not in str(m["content"]) for m in plan.messages)


def test_no_tools_is_a_plain_reply() -> None:
    plan = plan_reply(task(tools=[]), HERMES)
    assert (plan.tools, plan.grammar, plan.format) == (None, None, "hermes")
    assert isinstance(plan.parser(), PlainReply)


def test_native_history_is_as_hugging_face_templates_expect_it() -> None:
    plan = plan_reply(task(messages=HISTORY), HERMES)
    assert plan.messages == [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "not json"},
                },
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": "Sunny, 21 °C",
            "name": "get_weather",
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00", "name": "get_time"},
    ]


def test_an_assistant_with_calls_and_no_text_has_no_content() -> None:
    calls = [
        ChatMessage(
            role="assistant", tool_calls=[ToolCall(id="c", name="get_time", arguments="{}")]
        )
    ]
    assert plan_reply(task(messages=calls), HERMES).messages[0]["content"] is None


def test_llama_gets_one_call_per_message_and_mistral_its_ids() -> None:
    llama = plan_reply(task(messages=HISTORY), LLAMA3).messages
    assert [len(m.get("tool_calls", [])) for m in llama] == [0, 1, 1, 0, 0]
    assert llama[1]["content"] == "Let me check." and llama[2]["content"] is None
    mistral = plan_reply(task(messages=HISTORY), MISTRAL).messages
    ids = [c["id"] for c in mistral[1]["tool_calls"]]
    assert ids == [history_id("mistral", "call_1"), history_id("mistral", "call_2")]
    assert [m["tool_call_id"] for m in mistral[2:]] == ids


def test_generic_describes_the_tools_in_the_system_message() -> None:
    plan = plan_reply(task(), CHATML)
    assert plan.tools is None
    system = plan.messages[0]
    assert system["role"] == "system"
    assert "- get_weather: The current weather in a city" in system["content"]
    assert '"city": {"type": "string"}' in system["content"]
    assert "Otherwise answer the user in plain text" in system["content"]
    assert '"response"' not in system["content"]
    assert plan.messages[1:] == [{"role": "user", "content": "Weather in Paris?"}]


def test_generic_auto_is_plain_text_or_the_calls_json() -> None:
    # Answering is as without tools (issue 35); only a reply that starts with the calls'
    # object is held to the grammar, from its brace.
    plan = plan_reply(task(), CHATML)
    assert plan.grammar is not None and plan.grammar.triggers
    assert oracle.accepts(plan.grammar, "It is sunny.")
    assert oracle.accepts(plan.grammar, '{"tool_response": "an echo is text"}')
    assert oracle.accepts(plan.grammar, " " + CALLS["generic"])
    assert oracle.accepts(plan.grammar, CALLS["generic"].replace("{", "{ ", 1))
    assert not oracle.accepts(plan.grammar, '{"tool_calls": [{"name": "nope", "arguments": {}}]}')
    assert not oracle.accepts(plan.grammar, CALLS["generic"] + " and more")
    assert oracle.lazy_sampler_accepts(plan.grammar, "It is sunny.")
    assert oracle.lazy_sampler_accepts(plan.grammar, CALLS["generic"])
    assert reply(plan, "Sunny.\nWarm.") == ("Sunny.\nWarm.", [])
    assert reply(plan, CALLS["generic"]) == ("", [("get_weather", '{"city": "Paris"}')])
    required = plan_reply(task(tool_choice=ToolChoice(mode="required")), CHATML)
    assert required.grammar is not None and not required.grammar.triggers
    assert not oracle.accepts(required.grammar, "It is sunny.")


def test_generic_merges_into_the_first_system_message() -> None:
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi"),
    ]
    plan = plan_reply(task(messages=messages, tool_choice=ToolChoice(mode="required")), CHATML)
    assert plan.format == "generic"
    assert plan.messages[0]["content"].startswith("Be brief.\n\nYou can use these tools:")
    assert "You must call a tool." in plan.messages[0]["content"]
    assert len(plan.messages) == 2
    named = plan_reply(task(tool_choice=ToolChoice(mode="function", name="get_time")), CHATML)
    assert "You must call the tool get_time." in named.messages[0]["content"]
    assert '"name": "get_time"' in named.messages[0]["content"]


def test_a_named_format_gets_the_tools_in_the_first_user_message() -> None:
    # llama-cpp-python's gemma format drops system messages.
    plan = plan_reply(task(tool_choice=ToolChoice(mode="required")), None)
    assert plan.format == "generic" and plan.messages[0]["role"] == "user"
    assert "You can use these tools:" in plan.messages[0]["content"]
    assert plan.messages[0]["content"].endswith("Weather in Paris?")


def test_generic_history_is_plain_text() -> None:
    plan = plan_reply(task(messages=HISTORY), CHATML)
    assert plan.messages[2] == {
        "role": "assistant",
        "content": 'Let me check.\n{"tool_calls":'
        ' [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time",'
        ' "arguments": "not json"}]}',
    }
    results = plan.messages[3]
    assert results["role"] == "user"
    assert [json.loads(line) for line in results["content"].split("\n")] == [
        {"tool_response": {"id": "call_1", "name": "get_weather", "content": "Sunny, 21 °C"}},
        {"tool_response": {"id": "call_2", "name": "get_time", "content": "12:00"}},
    ]
    assert len(plan.messages) == 4
    assert all(
        isinstance(m["content"], str) and set(m) == {"role", "content"} for m in plan.messages
    )


@pytest.mark.parametrize("mode", ["auto", "none", "required"])
def test_generic_renders_through_smollm2s_own_template(mode: Any) -> None:
    plan = plan_reply(
        task(messages=HISTORY, tool_choice=ToolChoice(mode=mode)), oracle.chat_template()
    )
    formatter = Jinja2ChatFormatter(
        oracle.chat_template(), eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    prompt = formatter(messages=plan.messages).prompt  # type: ignore[arg-type]
    assert prompt.endswith("<|im_start|>assistant\n")
    assert '{"tool_response": {"id": "call_1"' in prompt
    assert ("You can use these tools" in prompt) is (mode != "none")
    if mode == "none":  # SmolLM2's own system message, as without tools
        assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_response_format_alone_is_its_grammar() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    plan = plan_reply(
        task(tools=[], response_format=ResponseFormat(type="json_schema", json_schema=schema)),
        HERMES,
    )
    assert plan.grammar is not None and not plan.grammar.triggers
    assert oracle.accepts(plan.grammar, '{"n": 3}')
    assert isinstance(plan.parser(), PlainReply)
    anything = plan_reply(task(tools=[], response_format=ResponseFormat(type="json_object")), None)
    assert anything.grammar is not None and oracle.accepts(anything.grammar, '{"a": [1]}')


def test_response_format_with_tools() -> None:
    answer = ResponseFormat(
        type="json_schema",
        json_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    )
    generic = plan_reply(task(response_format=answer), CHATML)
    assert generic.grammar is not None
    assert oracle.accepts(generic.grammar, '{"response": {"n": 3}}')
    assert oracle.accepts(generic.grammar, CALLS["generic"])
    assert reply(generic, '{"response": {"n": 3}}') == ('{"n": 3}', [])
    assert "follows this schema" in generic.messages[0]["content"]
    hermes = plan_reply(task(response_format=answer), HERMES)
    assert hermes.grammar is not None and not hermes.grammar.triggers
    assert oracle.accepts(hermes.grammar, '{"n": 3}')
    assert oracle.accepts(hermes.grammar, CALLS["hermes"])
    assert reply(hermes, '{"n": 3}') == ('{"n": 3}', [])
    mistral = plan_reply(task(response_format=answer), MISTRAL)
    assert reply(mistral, '[{"name": "get_time", "arguments": {}}]')[1] == []  # not bare here
    required = plan_reply(
        task(response_format=answer, tool_choice=ToolChoice(mode="required")), HERMES
    )
    assert required.grammar is not None and not oracle.accepts(required.grammar, '{"n": 3}')
    with pytest.raises(InvalidRequest, match="bare JSON"):
        plan_reply(task(response_format=answer), LLAMA3)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tool_choice": ToolChoice(mode="function", name="nope")}, "'nope', which is not among"),
        ({"tool_choice": ToolChoice(mode="required"), "tools": []}, "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "two functions are named 'get_weather'"),
        (
            {
                "tools": [
                    Tool(
                        name="f",
                        parameters={
                            "type": "object",
                            "properties": {"n": {"$ref": "#/$defs/N"}},
                        },
                    )
                ]
            },
            "the parameters of the function 'f': the JSON schema $ref '#/$defs/N' (at"
            " properties.n) points to nothing",
        ),
        ({"response_format": ResponseFormat(type="json_schema")}, "needs its schema"),
        (
            {"response_format": ResponseFormat(type="json_schema", json_schema={"not": {}})},
            "response_format: the JSON schema keyword 'not'",
        ),
        ({"messages": None, "prompt": "x"}, "needs messages"),
    ],
)
def test_what_cannot_be_honoured_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        plan_reply(task(**fields), HERMES)
    assert message in str(raised.value)


def test_the_ids_follow_the_task() -> None:
    plan = plan_reply(task(task_id="abc", tool_choice=ToolChoice(mode="required")), MISTRAL)
    parser = plan.parser()
    out = parser.feed(CALLS["mistral"])
    assert out.calls[0].id == call_id("mistral", "abc", 0)


def test_generic_instructions_go_to_the_user_when_the_template_refuses_a_system_message() -> None:
    gemma2 = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported')"
        " }}{% endif %}{% for message in messages %}{{ message['content'] }}{% endfor %}"
    )
    plan = plan_reply(task(), gemma2)
    assert [m["role"] for m in plan.messages] == ["user"]
    assert plan.messages[0]["content"].startswith("You can use these tools:")
    assert plan.messages[0]["content"].endswith("\n\nWeather in Paris?")
    formatter = Jinja2ChatFormatter(gemma2, eos_token="", bos_token="")
    assert "Weather in Paris?" in formatter(messages=plan.messages).prompt  # type: ignore[arg-type]
