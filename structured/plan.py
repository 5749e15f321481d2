"""What a chat task asks of the engine beyond sampling: the chat to render, the grammar the
reply must follow, and how to read the reply back.

- ``none`` (or no tools): no tools are described and no grammar applies (but
  ``response_format``'s); calls and results in the history are still rendered.
- ``auto``: native formats get a lazy grammar: the model writes freely, and from a call's
  marker on it can only write calls of the tools offered, their arguments matching the
  function's schema. ``generic``: plain text, or ``{"tool_calls": [...]}`` as the whole reply
  (lazy too, triggered by the object's start; with ``response_format``, the format's JSON as
  ``{"response": ...}`` instead of text, eager).
- ``required``: the whole reply is calls: ``<tool_call>`` blocks, ``[TOOL_CALLS][...]``,
  Llama's JSON call, ``{"tool_calls": [...]}``.
- a named function: as ``required``, that function only.

``parallel_tool_calls: false`` allows exactly one call, ``true`` one or more (Llama: always one).
With ``response_format`` too: when a call is required the tools win (the format is not
applied); with ``auto`` the reply is calls or the format's JSON (``generic``: the ``response``
value is that JSON, streamed as content as it is; ``hermes`` and ``mistral``: the whole reply is
one or the other); ``llama3`` cannot tell its bare JSON calls from the format's JSON, and the
task is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from events.catalogue import TaskCreated
from events.records import ResponseFormat, Tool
from structured.formats import ToolFormatName, tool_format
from structured.grammar import (
    OBJECT_SCHEMA,
    json_grammar,
    tool_grammar,
)
from structured.messages import (
    generic_instructions,
    generic_messages,
    openai_tools,
    refuses_system,
    template_messages,
)
from structured.parsers import ParserSpec, make_parser
from structured.reply import Grammar, InvalidRequest, PlainReply, ReplyParser
from structured.schema_checks import schema_problem
from structured.schema_keywords import SchemaError


@dataclass(frozen=True)
class ReplyPlan:
    """How to serve one chat task."""

    # The chat to render through the template (OpenAI-shaped dicts).
    messages: list[dict[str, Any]]
    # The tools to pass to the template (native formats only).
    tools: list[dict[str, Any]] | None
    grammar: Grammar | None
    format: ToolFormatName
    # How to read the reply; None: it is all content.
    reading: ParserSpec | None = None

    def parser(self) -> ReplyParser:
        """A fresh parser for this task's reply."""
        return PlainReply() if self.reading is None else make_parser(self.reading)


def plan_reply(task: TaskCreated, chat_template: str | None) -> ReplyPlan:
    """The plan for a chat task, for a model with this chat template (None: a named chat
    format). Raises ``InvalidRequest`` for what cannot be honoured."""
    if task.messages is None:
        raise InvalidRequest("a chat task needs messages")
    fmt = tool_format(chat_template)
    tools = list(task.tools)
    offered = _offered(task, tools)
    response = _response_schema(task.response_format)
    try:
        if not offered:
            return ReplyPlan(
                messages=generic_messages(task.messages, None)
                if fmt == "generic"
                else template_messages(task.messages, fmt),
                tools=None,
                grammar=None if response is None else json_grammar(response),
                format=fmt,
            )
        forced = task.tool_choice.mode != "auto"
        names = frozenset(t.name for t in offered)
        parallel = task.parallel_tool_calls
        if fmt == "generic":
            instructions = generic_instructions(
                tools,
                must=task.tool_choice.name if task.tool_choice.mode == "function" else None,
                required=forced,
                parallel=parallel,
                response=None if forced else response,
            )
            # auto, no response_format: plain text, or the calls' JSON from the reply's start.
            lazy = not forced and response is None
            answer = None if forced else response
            return ReplyPlan(
                messages=generic_messages(
                    task.messages, instructions, system=not refuses_system(chat_template)
                ),
                tools=None,
                grammar=tool_grammar(fmt, offered, parallel=parallel, lazy=lazy, response=answer),
                format=fmt,
                reading=ParserSpec(fmt, task.task_id, names),
            )
        if forced or response is None:
            grammar = tool_grammar(fmt, offered, parallel=parallel, lazy=not forced)
        elif fmt == "llama3":
            raise InvalidRequest(
                "this model writes its tool calls as bare JSON, which a reply in the"
                " response_format's JSON would be mistaken for: with response_format, send"
                " tool_choice 'none' or 'required'"
            )
        else:
            grammar = tool_grammar(fmt, offered, parallel=parallel, lazy=False, response=response)
        return ReplyPlan(
            messages=template_messages(task.messages, fmt),
            tools=openai_tools(tools),
            grammar=grammar,
            format=fmt,
            reading=ParserSpec(fmt, task.task_id, names, bare=forced or response is None),
        )
    except SchemaError as exc:  # pragma: no cover - _offered and _response_schema check first
        raise InvalidRequest(str(exc)) from exc


def _offered(task: TaskCreated, tools: list[Tool]) -> list[Tool]:
    """The functions the reply may call (none: it may call none)."""
    choice = task.tool_choice
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise InvalidRequest(f"tools: two functions are named {tool.name!r}")
        seen.add(tool.name)
        if (problem := schema_problem(tool.parameters, lenient=True)) is not None:
            raise InvalidRequest(f"the parameters of the function {tool.name!r}: {problem}")
    if choice.mode == "none":
        return []
    if choice.mode == "function":
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise InvalidRequest(
                f"tool_choice names the function {choice.name!r}, which is not among the tools"
            )
        return chosen
    if choice.mode == "required" and not tools:
        raise InvalidRequest("tool_choice 'required' needs tools")
    return tools


def _response_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    if response_format is None:
        return None
    if response_format.type == "json_object":
        return OBJECT_SCHEMA
    if response_format.json_schema is None:
        raise InvalidRequest("a json_schema response_format needs its schema")
    if (problem := schema_problem(response_format.json_schema)) is not None:
        raise InvalidRequest(f"response_format: {problem}")
    return response_format.json_schema
