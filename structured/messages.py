"""A chat as the model's chat template gets it: OpenAI-shaped message dicts.

Native formats get the history as Hugging Face templates expect it: an assistant's calls as
``tool_calls`` (arguments as an object), tool results as ``tool`` messages. The ``generic``
format is for templates that know only ``role`` and ``content`` (and fail on a None content):
calls become the assistant's content, written as the JSON the model is asked to write, and
tool results become user messages; what the tools are and how to call them goes into the
system message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from events.records import ChatMessage, Tool, ToolCall
from structured.formats import ToolFormatName, history_id


def openai_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools as chat templates take them."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]


def template_messages(messages: Sequence[ChatMessage], fmt: ToolFormatName) -> list[dict[str, Any]]:
    """The chat for a template that knows tools (a native format)."""
    names = _call_names(messages)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            calls = [_template_call(c, fmt) for c in m.tool_calls]
            # Llama's templates refuse a message with more than one call: one message each.
            groups = [[c] for c in calls] if fmt == "llama3" else [calls]
            for i, group in enumerate(groups):
                content = m.content if i == 0 and m.content else None
                message = {"role": "assistant", "content": content, "tool_calls": group}
                out.append(_with_reasoning(message, m) if i == 0 else message)
        elif m.role == "tool":
            call = m.tool_call_id or ""
            message = {"role": "tool", "tool_call_id": history_id(fmt, call), "content": m.content}
            if name := m.name or names.get(call):
                message["name"] = name
            out.append(message)
        else:
            message = {"role": m.role, "content": m.content}
            if m.name:
                message["name"] = m.name
            out.append(_with_reasoning(message, m))
    return out


def generic_messages(
    messages: Sequence[ChatMessage], instructions: str | None, system: bool = True
) -> list[dict[str, Any]]:
    """The chat for a template that knows nothing of tools, with ``instructions`` (how to call
    them) in its system message, or (``system`` false: a template that refuses one) at the
    start of the first user message."""
    names = _call_names(messages)
    out: list[dict[str, Any]] = []
    results: list[str] = []  # consecutive tool results: one user message

    def flush() -> None:
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results.clear()

    for m in messages:
        if m.role == "tool":
            call = m.tool_call_id or ""
            result: dict[str, Any] = {"id": call}
            if name := m.name or names.get(call):
                result["name"] = name
            result["content"] = m.content
            results.append(_json({"tool_response": result}))
            continue
        flush()
        if m.role == "assistant" and m.tool_calls:
            written = _json(
                {
                    "tool_calls": [
                        {"name": c.name, "arguments": _arguments(c.arguments)} for c in m.tool_calls
                    ]
                }
            )
            content = f"{m.content}\n{written}" if m.content else written
            out.append(_with_reasoning({"role": "assistant", "content": content}, m))
        else:
            out.append(_with_reasoning({"role": m.role, "content": m.content}, m))
    flush()
    if instructions and not system:
        first = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if first is None:
            out.insert(0, {"role": "user", "content": instructions})
        else:
            out[first] = {"role": "user", "content": f"{instructions}\n\n{out[first]['content']}"}
    elif instructions:
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {
                "role": "system",
                "content": f"{first}\n\n{instructions}" if first else instructions,
            }
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def refuses_system(chat_template: str | None) -> bool:
    """Whether a template raises on a system message (Gemma 2's, Mistral's first ones); a
    model served with a named format (None) is taken to, as llama-cpp-python's ``gemma``
    format drops system messages."""
    return chat_template is None or any(
        phrase in chat_template
        for phrase in ("System role not supported", "Only user and assistant roles are supported")
    )


def generic_instructions(
    tools: Sequence[Tool],
    *,
    must: str | None,
    required: bool,
    parallel: bool,
    response: dict[str, Any] | None,
) -> str:
    """What the system message says of the tools, for the ``generic`` format: short and
    plain, since small models read it. ``must``: the function that has to be called;
    ``required``: a call is required; ``response``: the schema a direct answer follows.

    With a choice (``auto``) the model answers in plain text, as it would with no tools, and
    only a reply that starts with the calls' JSON is a call (a lazy grammar): a small model
    asked to answer in JSON either way chose the calls' JSON for greetings, arithmetic, and
    after the tool's result was already in the chat (issue 35)."""
    lines = ["You can use these tools:"]
    for t in tools:
        lines.append(f"- {t.name}: {t.description}" if t.description else f"- {t.name}")
        lines.append(f"  arguments (JSON schema): {_json(t.parameters)}")
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
    if must is not None:
        call = call.replace("<tool name>", must)
        lines.append(f"You must call the tool {must}. Answer with this JSON only: {call}")
    elif required:
        lines.append(f"You must call a tool. Answer with this JSON only: {call}")
    else:
        lines.append(f"To call a tool, answer with this JSON only: {call}")
    lines.append(
        'To call several tools at once, put each call in the "tool_calls" list.'
        if parallel
        else "Call one tool at a time."
    )
    if must is None and not required:
        if response is None:
            lines.append("Otherwise answer the user in plain text, without JSON.")
        else:
            schema = _json(response)
            answer = f'{{"response": <your answer as JSON that follows this schema: {schema}>}}'
            lines.append(f"Otherwise, answer with this JSON only: {answer}")
    lines.append(
        'A tool\'s result comes back in a message like {"tool_response": {"id": "<call id>",'
        ' "name": "<tool name>", "content": "<result>"}}.'
    )
    if must is None and not required:
        lines.append("Once a tool's result is there, answer the user with it; do not call again.")
    return "\n".join(lines)


def _with_reasoning(message: dict[str, Any], m: ChatMessage) -> dict[str, Any]:
    """An assistant's earlier thinking, sent back by the client, as ``reasoning_content`` (the
    name Qwen3's and other templates read): the template keeps or drops it (R1's and Qwen3's
    drop it from turns before the last question)."""
    if m.role == "assistant" and m.reasoning:
        return message | {"reasoning_content": m.reasoning}
    return message


def _call_names(messages: Sequence[ChatMessage]) -> dict[str, str]:
    """Which function each call id of the history called (a tool message names it)."""
    return {c.id: c.name for m in messages for c in m.tool_calls}


def _template_call(call: ToolCall, fmt: ToolFormatName) -> dict[str, Any]:
    return {
        "id": history_id(fmt, call.id),
        "type": "function",
        "function": {"name": call.name, "arguments": _arguments(call.arguments)},
    }


def _arguments(text: str) -> Any:
    """A call's arguments as templates want them: the object, or the text itself when it
    is no JSON object (templates write that as it is)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)
