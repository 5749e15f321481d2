"""A chat task through the runner's own path (``prepare``, the engine, ``steps``) on a real model,
in each tool-call format: SmolLM2's weights in GGUF copies whose chat template is of each kind,
as a user's Qwen, Mistral or Llama GGUF would carry (made with the `gguf` package's
`gguf-new-metadata`). The grammar makes even a 135M model write a well-formed call."""

from __future__ import annotations

import json

import pytest

from events.catalogue import TaskCreated
from events.records import ChatMessage, SamplingParams, Tool, ToolCall, ToolChoice
from harness.models.templated import SMOLLM2, WithTemplate
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.generation import Step, check_request, steps
from inference.job import prepare
from structured import plan_reply
from structured.reply import InvalidRequest
from tests.inference.served import Served, calls_of

# Short templates of each kind (the markers and shapes of Qwen 2.5's, Mistral v0.3's and
# Llama 3.1's), not the originals.
HERMES = (
    "{%- if tools %}<|im_start|>system\nYou can call these functions: <tools>"
    "{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\nTo call one, write"
    ' <tool_call>{"name": <function name>, "arguments": <arguments>}</tool_call><|im_end|>\n'
    "{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    '{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% else %}{{ m.content }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
MISTRAL = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)
LLAMA3 = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\nEnvironment: ipython\n"
    "Functions: {{ tools | tojson }}<|eot_id|>{% endif %}{%- for m in messages %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n{% if m.tool_calls %}<|python_tag|>"
    '{{ {"name": m.tool_calls[0].function.name, "parameters": m.tool_calls[0].function.arguments}'
    " | tojson }}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{% endif %}"
)
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": ""}
WEATHER = Tool(
    name="get_weather",
    description="The current weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = Tool(
    name="get_time", parameters={"type": "object", "properties": {"zone": {"type": "string"}}}
)
ASK = [ChatMessage(role="user", content="What is the weather in Paris?")]


@pytest.fixture(scope="module", params=["hermes", "mistral", "llama3", "generic"])
def engine(request: pytest.FixtureRequest, smollm2_with_template: WithTemplate) -> LlamaCppEngine:
    fmt: str = request.param
    path = SMOLLM2
    if fmt != "generic":
        path = smollm2_with_template({"hermes": HERMES, "mistral": MISTRAL, "llama3": LLAMA3}[fmt])
    loaded = LlamaCppEngine(path, n_ctx=1024, n_threads=1)
    loaded.load()
    return loaded


def serve(engine: LlamaCppEngine, task: TaskCreated) -> tuple[list[Step], str]:
    """The steps, and the text the model wrote (markers and calls included)."""
    job = prepare(engine, task)
    limit = check_request(len(job.prompt), task.params, engine.n_ctx)
    out = [
        s
        for s in steps(engine, job.prompt, job.decoding, limit, lambda: False, job.reply)
        if isinstance(s, Step)
    ]
    written = b"".join(engine.spelled(s.token_id) for s in out if s.token_id is not None)
    return out, written.decode(errors="replace")


def as_served(out: list[Step]) -> list[Served]:
    return [(s.token_id, s.text, s.tool_calls, s.finish_reason) for s in out]


def chat(**fields: object) -> TaskCreated:
    return TaskCreated.model_validate(
        {
            "task_id": "t",
            "model_id": "m",
            "origin": "test",
            "messages": ASK,
            "tools": [WEATHER, TIME],
            "params": SamplingParams(temperature=0, max_tokens=80),
            **fields,
        }
    )


def test_each_format_is_picked_from_the_template(engine: LlamaCppEngine) -> None:
    fmt = plan_reply(chat(), engine.chat_template).format
    assert fmt == {HERMES: "hermes", MISTRAL: "mistral", LLAMA3: "llama3"}.get(
        engine.chat_template or "", "generic"
    )


def test_a_required_call_is_a_call_of_an_offered_function(engine: LlamaCppEngine) -> None:
    fmt = plan_reply(chat(), engine.chat_template).format
    task = chat(
        tool_choice=ToolChoice(mode="function", name="get_weather"), parallel_tool_calls=False
    )
    out, written = serve(engine, task)
    assert out[-1].finish_reason == "tool_calls", written
    calls = calls_of(as_served(out))
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert isinstance(json.loads(calls[0]["arguments"])["city"], str)
    assert len(calls[0]["id"]) == (9 if fmt == "mistral" else 29)
    assert written.startswith(MARKERS.get(fmt, "")), written
    assert "".join(s.text for s in out).strip() == ""  # a call, no text beside it


def test_auto_is_text_or_a_call_and_never_a_broken_one(engine: LlamaCppEngine) -> None:
    out, written = serve(engine, chat())
    calls = calls_of(as_served(out))
    if out[-1].finish_reason == "tool_calls":
        assert all(c["name"] in ("get_weather", "get_time") for c in calls.values())
        assert all(isinstance(json.loads(c["arguments"]), dict) for c in calls.values())
    else:  # an answer (this model may also end at once: an empty one)
        assert not calls, written


def test_a_call_and_its_result_render_through_the_template(engine: LlamaCppEngine) -> None:
    history = [
        *ASK,
        ChatMessage(
            role="assistant",
            tool_calls=[ToolCall(id="call_abc", name="get_weather", arguments='{"city": "Paris"}')],
        ),
        ChatMessage(role="tool", tool_call_id="call_abc", content="Sunny, 24 degrees."),
    ]
    job = prepare(engine, chat(messages=history, tool_choice=ToolChoice(mode="none")))
    text = bytes(engine.llm.detokenize(job.prompt, special=True)).decode()
    assert "Sunny, 24 degrees." in text and "Paris" in text
    assert job.decoding.grammar is None


def test_prompt_token_ids_outside_the_vocabulary_are_refused(engine: LlamaCppEngine) -> None:
    task = TaskCreated(
        task_id="t",
        model_id="m",
        origin="test",
        kind="completion",
        prompt_token_ids=[1, engine.n_vocab],
    )
    with pytest.raises(InvalidRequest, match="outside the model's vocabulary"):
        prepare(engine, task)
    ok = TaskCreated(
        task_id="t", model_id="m", origin="test", kind="completion", prompt_token_ids=[1, 2, 3]
    )
    assert prepare(engine, ok).prompt == [1, 2, 3]
