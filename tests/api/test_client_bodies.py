"""What Claude Code and Codex really send (``tests/clients/fixtures``, recorded from the pinned
CLIs by ``python -m tests.clients.capture``) is accepted, and becomes the task it should: the
tools offered (deferred and hosted ones left out, a namespace's functions flattened), their
grammars built, the thinking and its budget. Fast: bodies in, task fields out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api.anthropic.messages import MessagesRequest, task_for
from api.errors import _validation_message
from api.reply import Call, Reply
from api.responses.requests import ResponsesRequest, chat_task
from api.responses.shapes import Head, ResponseStream, output_items
from events.catalogue import ChunkGenerated
from events.records import SamplingParams, ToolCallDelta
from structured.grammar import tool_grammar
from structured.schema import dropped
from tests.structured import oracle

FIXTURES = Path(__file__).parents[1] / "clients" / "fixtures"


def bodies(client: str) -> list[dict[str, Any]]:
    found = sorted(FIXTURES.glob(f"{client}-[0-9][0-9]-*.json"))
    requests = [json.loads(p.read_text()) for p in found]
    return [r["body"] for r in requests if r["method"] == "POST"]


CLAUDE = bodies("claude")
HAIKU = bodies("claude-haiku")
CODEX = bodies("codex")


def test_there_are_fixtures_of_both_clients_and_their_tool_round_trip() -> None:
    assert len(CLAUDE) == 2 and len(HAIKU) == 1 and len(CODEX) == 2
    last = CLAUDE[1]["messages"]
    assert any(
        b.get("type") == "tool_result" for m in last for b in m["content"] if isinstance(b, dict)
    )
    assert any(i.get("type") == "function_call_output" for i in CODEX[1]["input"])


@pytest.mark.parametrize("body", CLAUDE + HAIKU, ids=lambda b: b["model"])
def test_claude_code_s_requests_are_accepted(body: dict[str, Any]) -> None:
    request = MessagesRequest.model_validate(body)
    task = task_for(request, "m", "api", request.sampling())
    offered = [t.name for t in task.tools]
    # Its deferred placeholder is not offered (it says never to call it); the rest are.
    given = [t["name"] for t in body["tools"]]
    assert "DeferredToolPlaceholder" in given and "DeferredToolPlaceholder" not in offered
    assert offered == [n for n in given if n != "DeferredToolPlaceholder"]
    assert "Bash" in offered and task.tool_choice.mode == "auto"
    # Its thinking: asked for (adaptive with an effort, or enabled with a budget), not shown.
    assert task.thinking is True and not request.thinking_shown
    if body["thinking"]["type"] == "adaptive":
        assert body["output_config"]["effort"] == "high"
        assert task.thinking_budget == 16384  # high's budget
    else:
        assert task.thinking_budget == body["thinking"]["budget_tokens"]
    assert body["context_management"]["edits"][0]["type"].startswith("clear_thinking_")
    # Every tool's grammar builds (integer bounds included), and llama.cpp parses it.
    grammar = tool_grammar("generic", task.tools, parallel=True, lazy=True)
    assert oracle.parses(grammar.gbnf)


def test_claude_code_s_schemas_lose_only_what_a_grammar_cannot_say() -> None:
    tools = {t["name"]: t["input_schema"] for t in CLAUDE[0]["tools"]}
    left_out = {name: dropped(schema) for name, schema in tools.items() if dropped(schema)}
    assert left_out == {"Workflow": ["properties.script.maxLength"]}
    assert tools["Read"]["properties"]["offset"]["minimum"] == 0  # kept: in the grammar


def test_claude_code_s_tool_round_trip_reads_as_a_conversation() -> None:
    request = MessagesRequest.model_validate(CLAUDE[1])
    messages = request.chat_messages()
    calls = [c for m in messages for c in m.tool_calls]
    results = [m for m in messages if m.role == "tool"]
    assert [c.name for c in calls] == ["Bash"]
    assert results and results[0].tool_call_id == calls[0].id
    assert "shoal-capture" in str(results[0].content)


@pytest.mark.parametrize("body", CODEX, ids=["prompt", "tool-result"])
def test_codex_s_requests_are_accepted(body: dict[str, Any]) -> None:
    request = ResponsesRequest.model_validate(body)
    assert request.include == ["reasoning.encrypted_content"] and request.store is False
    task = chat_task(request, request.input_messages(), "m", "api", SamplingParams())
    names = [t.name for t in task.tools]
    kinds = [t["type"] for t in body["tools"]]
    assert "namespace" in kinds and "web_search" in kinds
    # The namespace's functions are offered as functions; web_search is left out.
    spaced = next(t for t in body["tools"] if t["type"] == "namespace")
    inner = [f["name"] for f in spaced["tools"]]
    assert set(inner) <= set(names) and "exec_command" in names
    assert len(names) == kinds.count("function") + len(inner)
    assert request.namespaces() == dict.fromkeys(inner, spaced["name"])
    grammar = tool_grammar("generic", task.tools, parallel=True, lazy=True)
    assert oracle.parses(grammar.gbnf)


def test_a_call_of_a_namespace_s_function_names_its_namespace() -> None:
    request = ResponsesRequest.model_validate(CODEX[0])
    spaced = next(t for t in CODEX[0]["tools"] if t["type"] == "namespace")
    name = spaced["tools"][0]["name"]
    head = Head("resp_t", "t", "m", 0, namespaces=request.namespaces())
    reply = Reply(
        calls={0: Call(id="call_1", name=name, arguments="{}")}, finish_reason="tool_calls"
    )
    whole = output_items("t", reply, namespaces=head.namespaces)
    assert whole[-1]["namespace"] == spaced["name"] and whole[-1]["name"] == name
    stream = ResponseStream(head)
    stream.start()
    stream.feed(
        ChunkGenerated(
            task_id="t",
            origin="test",
            idx=0,
            text="",
            tool_calls=(ToolCallDelta(index=0, id="call_1", name=name),),
        )
    )
    assert stream.items[-1]["namespace"] == spaced["name"]
    plain = output_items("t", Reply(calls={0: Call(id="c", name="exec_command", arguments="{}")}))
    assert "namespace" not in plain[-1]


def _first_error(model: type[MessagesRequest] | type[ResponsesRequest], body: Any) -> str:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]
    message, _ = _validation_message(RequestValidationError(errors))
    return message


def test_several_errors_give_the_first_one_s_own_message_and_field() -> None:
    body = json.loads(json.dumps(CLAUDE[0]))
    body["tools"][1]["input_schema"]["properties"]["command"] = {"$ref": "#/nowhere"}
    body["output_config"]["effort"] = "enormous"
    body["metadata"] = {"user_id": 5}
    assert _first_error(MessagesRequest, body) == (
        "tools.1.input_schema: the JSON schema $ref '#/nowhere' (at properties.command) points"
        " to nothing"
    )
    body = json.loads(json.dumps(CODEX[0]))
    body["include"].append("message.output_text.logprobs")
    body["temperature"] = "warm"
    assert _first_error(ResponsesRequest, body).startswith("temperature: ")
    # A union: the branch that went into the value says what is wrong in it.
    system = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    said = _first_error(MessagesRequest, system | {"system": [{"type": "text", "text": 3}]})
    assert said == "system.0.text: Input should be a valid string"
    said = _first_error(MessagesRequest, system | {"system": 3})
    assert said.startswith("system: not a valid value for this field")
